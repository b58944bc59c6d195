import copy

import pytest
from deepmerge import MergeError, merge, merge_all

BASE = {
    "name": "svc",
    "db": {"host": "localhost", "port": 5432, "options": {"ssl": False, "pool": 5}},
    "plugins": ["auth", "log"],
    "tags": ["a"],
    "debug": True,
}


def conflict_path(base, override):
    with pytest.raises(MergeError) as info:
        merge(base, override)
    assert isinstance(info.value, ValueError)
    assert info.value.path in str(info.value)
    return info.value.path


def test_recursive_merge_keeps_other_keys():
    out = merge(BASE, {"db": {"port": 6543, "options": {"ssl": True}}, "extra": 1})
    assert out["db"] == {"host": "localhost", "port": 6543, "options": {"ssl": True, "pool": 5}}
    assert out["name"] == "svc" and out["extra"] == 1 and out["plugins"] == ["auth", "log"]


def test_lists_are_replaced_and_scalars_change_type():
    out = merge(BASE, {"plugins": ["metrics"], "debug": "verbose", "name": 3})
    assert out["plugins"] == ["metrics"]
    assert out["debug"] == "verbose" and out["name"] == 3
    assert merge({"a": [1, 2]}, {"a": []}) == {"a": []}


def test_append_marker():
    out = merge(BASE, {"plugins": {"__append__": ["metrics", "trace"]}})
    assert out["plugins"] == ["auth", "log", "metrics", "trace"]
    assert merge({"a": {"l": [1]}}, {"a": {"l": {"__append__": []}}}) == {"a": {"l": [1]}}


def test_append_to_missing_or_none_and_markers_in_new_subtrees():
    assert merge({}, {"l": {"__append__": [1, 2]}}) == {"l": [1, 2]}
    assert merge({"l": None}, {"l": {"__append__": [3]}}) == {"l": [3]}
    new = {"a": {"x": None, "l": {"__append__": [1]}, "d": {"y": None, "z": 2}}}
    assert merge({}, new) == {"a": {"l": [1], "d": {"z": 2}}}
    assert merge({"k": None}, {"k": {"q": 1}}) == {"k": {"q": 1}}


def test_none_deletes():
    out = merge(BASE, {"debug": None, "db": {"options": {"pool": None}}, "missing": None})
    assert "debug" not in out and "missing" not in out
    assert out["db"]["options"] == {"ssl": False}
    assert merge({"a": {"b": 1}}, {"a": None}) == {}


def test_type_conflicts_report_dotted_path():
    assert conflict_path(BASE, {"db": {"port": {"x": 1}}}) == "db.port"
    assert conflict_path(BASE, {"db": {"options": "none"}}) == "db.options"
    assert conflict_path(BASE, {"plugins": "auth"}) == "plugins"
    assert conflict_path(BASE, {"name": ["a"]}) == "name"
    assert conflict_path({"a": {"b": {"c": [1]}}}, {"a": {"b": {"c": {"d": 1}}}}) == "a.b.c"


def test_bad_append_markers():
    assert conflict_path(BASE, {"db": {"host": {"__append__": ["x"]}}}) == "db.host"
    assert conflict_path(BASE, {"db": {"__append__": ["x"]}}) == "db"
    assert conflict_path(BASE, {"tags": {"__append__": "b"}}) == "tags"
    assert conflict_path(BASE, {"tags": {"__append__": ["b"], "other": 1}}) == "tags"
    assert conflict_path({}, {"new": {"deep": {"__append__": 5}}}) == "new.deep"


def test_inputs_are_not_modified():
    base = copy.deepcopy(BASE)
    override = {"db": {"options": {"ssl": True}}, "plugins": {"__append__": ["x"]}, "debug": None, "n": {"l": [1]}}
    snapshot = copy.deepcopy(override)
    merge(base, override)
    assert base == BASE and override == snapshot


def test_result_shares_nothing_with_inputs():
    base = copy.deepcopy(BASE)
    override = {"n": {"l": [1, [2]]}, "tags": ["z", {"k": 1}], "plugins": {"__append__": [["p"]]}}
    out = merge(base, override)
    out["db"]["options"]["pool"] = 99
    out["n"]["l"][1].append(3)
    out["tags"][1]["k"] = 2
    out["plugins"][2].append("q")
    out["db"]["host"] = "elsewhere"
    assert base == BASE
    assert override == {"n": {"l": [1, [2]]}, "tags": ["z", {"k": 1}], "plugins": {"__append__": [["p"]]}}


def test_merge_all():
    a = {"x": 1, "l": [1]}
    b = {"l": {"__append__": [2]}, "y": {"z": 1}}
    c = {"x": None, "y": {"w": 2}, "l": {"__append__": [3]}}
    assert merge_all(a, b, c) == {"l": [1, 2, 3], "y": {"z": 1, "w": 2}}
    assert merge_all() == {}
    single = {"a": {"b": [1]}, "n": None, "m": {"__append__": [4]}}
    out = merge_all(single)
    assert out == {"a": {"b": [1]}, "m": [4]}
    out["a"]["b"].append(2)
    assert single["a"]["b"] == [1]


def test_non_dict_arguments():
    for args in [([], {}), ({}, []), (None, {}), ({}, "x")]:
        with pytest.raises(TypeError):
            merge(*args)
