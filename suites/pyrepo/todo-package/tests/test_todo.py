import json
import os
import subprocess
import sys
from datetime import date

import pytest


def cli(path, *args):
    return subprocess.run(
        [sys.executable, "-m", "todo", "--file", str(path), *args],
        cwd=os.getcwd(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def ok(path, *args):
    p = cli(path, *args)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    return p.stdout


def failed(path, *args):
    p = cli(path, *args)
    assert p.returncode == 1
    assert p.stdout == ""
    assert p.stderr.startswith("error: ")


@pytest.fixture
def app(capsys):
    """Runs todo.cli.main in this process; ok() returns stdout, failed() checks an error exit."""
    from todo.cli import main

    class App:
        def run(self, path, *args):
            capsys.readouterr()
            rc = main(["--file", str(path), *args])
            out, err = capsys.readouterr()
            return rc, out, err

        def ok(self, path, *args):
            rc, out, err = self.run(path, *args)
            assert (rc, err) == (0, ""), err
            return out

        def failed(self, path, *args):
            rc, out, err = self.run(path, *args)
            assert rc == 1 and out == "" and err.startswith("error: "), (rc, out, err)

    return App()


def sample_tasks():
    from todo.model import Task

    return [
        Task(1, "Call mom", done=True),
        Task(2, "Pay rent", ["home", "money"], date(2026, 12, 1)),
        Task(3, "Buy milk", ["Shopping", "home"], date(2026, 11, 28)),
        Task(4, "Read book"),
        Task(5, "Taxes", ["money"], date(2026, 11, 28), done=True),
        Task(6, "Fix bike", ["home"], date(2027, 1, 15)),
    ]


def ids(tasks):
    return [t.id for t in tasks]


def test_task_normalizes_and_validates():
    from todo.model import Task

    t = Task(7, "  Water plants ", ["Home", "b", "home"])
    assert t.title == "Water plants" and t.tags == ("b", "home")
    assert t.due is None and t.done is False
    for kwargs in ({"title": "   "}, {"title": "x", "tags": ["no spaces"]}, {"title": "x", "tags": ["a_b"]}):
        with pytest.raises(ValueError):
            Task(1, **kwargs)
    with pytest.raises(ValueError):
        Task(0, "x")


def test_task_dict_round_trip():
    from todo.model import Task

    t = Task(3, "Buy milk", ["shopping", "home"], date(2026, 12, 1))
    assert t.to_dict() == {
        "id": 3,
        "title": "Buy milk",
        "tags": ["home", "shopping"],
        "due": "2026-12-01",
        "done": False,
    }
    assert Task.from_dict(t.to_dict()) == t
    done = Task(1, "x", done=True)
    assert done.to_dict()["due"] is None
    assert Task.from_dict(json.loads(json.dumps(done.to_dict()))) == done


def test_select_status_and_order():
    from todo.query import select

    TASKS = sample_tasks()
    assert ids(select(TASKS)) == [3, 2, 6, 4]
    assert ids(select(TASKS, status="done")) == [5, 1]
    assert ids(select(TASKS, status="all")) == [3, 5, 2, 6, 1, 4]
    with pytest.raises(ValueError):
        select(TASKS, status="closed")


def test_select_tag_and_before():
    from todo.query import select

    TASKS = sample_tasks()
    assert ids(select(TASKS, tag="home")) == [3, 2, 6]
    assert ids(select(TASKS, tag="SHOPPING")) == [3]
    assert ids(select(TASKS, before=date(2026, 12, 1))) == [3]
    assert ids(select(TASKS, before=date(2026, 12, 2), status="all")) == [3, 5, 2]
    assert ids(select(TASKS, tag="money", before=date(2030, 1, 1), status="all")) == [5, 2]
    assert select([], tag="x") == []


def test_storage_round_trip_and_format(tmp_path):
    from todo.storage import TodoList, load, save

    TASKS = sample_tasks()
    path = tmp_path / "t.json"
    assert load(path) == TodoList() and load(path).next_id == 1
    save(path, TodoList([TASKS[2], TASKS[0]], next_id=9))
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["next_id"] == 9
    assert [d["id"] for d in data["tasks"]] == [1, 3]
    assert data["tasks"][1] == TASKS[2].to_dict()
    loaded = load(path)
    assert loaded.next_id == 9 and loaded.tasks == [TASKS[0], TASKS[2]]


def test_save_replaces_the_file_and_leaves_nothing_else(tmp_path):
    from todo.storage import TodoList, load, save

    TASKS = sample_tasks()
    path = tmp_path / "t.json"
    save(path, TodoList(TASKS[:2], next_id=3))
    inode = os.stat(path).st_ino
    keep = tmp_path / "keep.txt"
    keep.write_text("x")
    save(path, TodoList(TASKS, next_id=7))
    assert os.stat(path).st_ino != inode  # a new file was moved into place, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "t.json"]
    assert load(path).next_id == 7


def test_failed_save_keeps_old_content(tmp_path):
    from todo.model import Task
    from todo.storage import TodoList, save

    TASKS = sample_tasks()

    class Broken(Task):
        def to_dict(self):
            raise RuntimeError("disk on fire")

    path = tmp_path / "t.json"
    save(path, TodoList(TASKS[:2], next_id=3))
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017 - any error, as long as the old file survives
        save(path, TodoList([TASKS[0], Broken(9, "boom")], next_id=10))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_load_rejects_garbage(tmp_path):
    from todo.storage import load

    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ValueError):
        load(path)
    path.write_text('{"version": 1}')
    with pytest.raises(ValueError):
        load(path)


def test_cli_add_and_list(tmp_path):
    f = tmp_path / "todo.json"
    assert ok(f, "list") == "no tasks\n"
    assert not f.exists()
    assert ok(f, "add", "Call mom") == "added #1: Call mom\n"
    assert (
        ok(f, "add", "Buy milk", "--tag", "shopping", "--tag", "Home", "--due", "2026-12-01") == "added #2: Buy milk\n"
    )
    assert ok(f, "add", "  Pay rent ", "--due", "2026-11-30") == "added #3: Pay rent\n"
    assert (
        ok(f, "list")
        == "#3 [ ] Pay rent due:2026-11-30\n#2 [ ] Buy milk due:2026-12-01 +home +shopping\n#1 [ ] Call mom\n"
    )


def test_cli_done_and_status_filters(tmp_path, app):
    f = tmp_path / "todo.json"
    for title in ("a", "b", "c"):
        app.ok(f, "add", title)
    assert app.ok(f, "done", "3", "1") == "done #3\ndone #1\n"
    assert app.ok(f, "done", "1") == "done #1\n"
    assert app.ok(f, "list") == "#2 [ ] b\n"
    assert app.ok(f, "list", "--done") == "#1 [x] a\n#3 [x] c\n"
    assert app.ok(f, "list", "--all") == "#1 [x] a\n#2 [ ] b\n#3 [x] c\n"


def test_cli_list_filters(tmp_path, app):
    f = tmp_path / "todo.json"
    app.ok(f, "add", "one", "--tag", "work", "--due", "2026-12-05")
    app.ok(f, "add", "two", "--tag", "home", "--due", "2026-12-01")
    app.ok(f, "add", "three", "--tag", "work")
    assert app.ok(f, "list", "--tag", "work") == "#1 [ ] one due:2026-12-05 +work\n#3 [ ] three +work\n"
    assert app.ok(f, "list", "--before", "2026-12-05") == "#2 [ ] two due:2026-12-01 +home\n"
    assert app.ok(f, "list", "--tag", "home", "--before", "2026-12-01") == "no tasks\n"


def test_cli_rm_and_ids_never_reused(tmp_path, app):
    f = tmp_path / "todo.json"
    app.ok(f, "add", "a")
    app.ok(f, "add", "b")
    assert app.ok(f, "rm", "2") == "removed #2\n"
    assert app.ok(f, "add", "c") == "added #3: c\n"
    assert app.ok(f, "list") == "#1 [ ] a\n#3 [ ] c\n"
    data = json.loads(f.read_text())
    assert data["next_id"] == 4 and [t["id"] for t in data["tasks"]] == [1, 3]


def test_cli_unknown_ids_change_nothing(tmp_path, app):
    f = tmp_path / "todo.json"
    app.ok(f, "add", "a")
    app.ok(f, "add", "b")
    before = f.read_text()
    app.failed(f, "done", "1", "7")
    app.failed(f, "rm", "2", "9")
    assert f.read_text() == before
    assert app.ok(f, "list") == "#1 [ ] a\n#2 [ ] b\n"


def test_cli_bad_values(tmp_path, app):
    f = tmp_path / "todo.json"
    app.ok(f, "add", "a")
    before = f.read_text()
    app.failed(f, "add", "   ")
    app.failed(f, "add", "x", "--tag", "bad tag")
    app.failed(f, "add", "x", "--due", "2026-02-30")
    app.failed(f, "add", "x", "--due", "tomorrow")
    app.failed(f, "list", "--before", "2026-13-01")
    assert f.read_text() == before


def test_cli_tags(tmp_path, app):
    f = tmp_path / "todo.json"
    assert app.ok(f, "tags") == ""
    app.ok(f, "add", "a", "--tag", "work", "--tag", "urgent")
    app.ok(f, "add", "b", "--tag", "work")
    app.ok(f, "add", "c", "--tag", "home")
    app.ok(f, "done", "3")
    assert app.ok(f, "tags") == "urgent 1\nwork 2\n"


def test_cli_reads_a_hand_written_file(tmp_path, app):
    f = tmp_path / "todo.json"
    tasks = [
        {"id": 5, "title": "Later", "tags": [], "due": None, "done": False},
        {"id": 2, "title": "Soon", "tags": ["x"], "due": "2026-01-02", "done": False},
    ]
    f.write_text(json.dumps({"version": 1, "next_id": 8, "tasks": tasks}))
    assert app.ok(f, "list") == "#2 [ ] Soon due:2026-01-02 +x\n#5 [ ] Later\n"
    assert app.ok(f, "add", "New") == "added #8: New\n"


def test_cli_list_and_tags_do_not_write(tmp_path, app):
    f = tmp_path / "todo.json"
    app.ok(f, "add", "a", "--tag", "t")
    os.utime(f, (1_000_000, 1_000_000))
    app.ok(f, "list")
    app.ok(f, "tags")
    app.ok(f, "list", "--all", "--tag", "t")
    assert os.stat(f).st_mtime == 1_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["todo.json"]


def test_python_m_todo_error_exit(tmp_path):
    f = tmp_path / "todo.json"
    failed(f, "done", "1")
    assert not f.exists()
