import difflib  # the reference; linediff itself must not use it
import os
import random
import subprocess
import sys

import pytest
from linediff import PatchError, apply, diff


def ref(a, b, n=3, fromfile="a", tofile="b"):
    lines = list(difflib.unified_diff(a, b, fromfile, tofile, n=n, lineterm=""))
    return "\n".join(lines) + "\n" if lines else ""


def lcs_len(a, b):
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def ref_apply(a, patch):
    """Independent applier: trusts the hunk headers."""
    lines = patch.split("\n")[:-1]
    out, pos, k = [], 0, 2
    while k < len(lines):
        head = lines[k].split(" ")
        old = head[1][1:].split(",")
        s1, l1 = int(old[0]), int(old[1]) if len(old) > 1 else 1
        start = s1 if l1 == 0 else s1 - 1
        out += a[pos:start]
        k += 1
        while k < len(lines) and not lines[k].startswith("@@"):
            if lines[k][0] in " +":
                out.append(lines[k][1:])
            k += 1
        pos = start + l1
    return out + a[pos:]


def check_structure(a, b, patch):
    body = [x for x in patch.split("\n")[2:-1] if not x.startswith("@@")]
    changed = sum(1 for x in body if x[0] in "+-")
    assert changed == len(a) + len(b) - 2 * lcs_len(a, b), patch
    assert ref_apply(a, patch) == b


def test_identical_is_empty():
    assert diff([], []) == ""
    assert diff(["x", "y"], ["x", "y"]) == ""


def test_simple_replace_exact():
    a = ["one", "two", "three", "four", "five"]
    b = ["one", "two", "THREE", "four", "five"]
    assert diff(a, b) == ("--- a\n+++ b\n@@ -1,5 +1,5 @@\n one\n two\n-three\n+THREE\n four\n five\n")
    assert diff(a, b) == ref(a, b)


def test_headers_and_single_line_ranges():
    a = [f"l{i}" for i in range(10)]
    b = list(a)
    b[5] = "X"
    assert diff(a, b, n=0, fromfile="old.txt", tofile="new.txt") == ("--- old.txt\n+++ new.txt\n@@ -6 +6 @@\n-l5\n+X\n")


def test_empty_sides():
    assert diff([], ["a", "b"]) == "--- a\n+++ b\n@@ -0,0 +1,2 @@\n+a\n+b\n"
    assert diff(["a"], []) == "--- a\n+++ b\n@@ -1 +0,0 @@\n-a\n"
    assert diff(["a", "b", "c"], []) == ref(["a", "b", "c"], [])


def test_insert_at_start_and_end():
    a = [str(i) for i in range(8)]
    for b in (["new"] + a, a + ["new"], a[:4] + ["mid1", "mid2"] + a[4:]):
        assert diff(a, b) == ref(a, b)
        assert diff(a, b, n=0) == ref(a, b, n=0)


def test_hunks_merge_when_gap_at_most_2n():
    a = [f"line{i}" for i in range(30)]
    b = list(a)
    b[5] = "changed5"
    b[11] = "changed11"  # 5 unchanged lines between: one hunk with n=3
    b[25] = "changed25"
    got = diff(a, b)
    assert got == ref(a, b)
    assert got.count("@@ -") == 2
    assert diff(a, b, n=2) == ref(a, b, n=2)
    assert diff(a, b, n=2).count("@@ -") == 3
    assert diff(a, b, n=1) == ref(a, b, n=1)


def test_deletions_before_insertions():
    a = ["keep", "old1", "old2", "keep2"]
    b = ["keep", "new1", "new2", "new3", "keep2"]
    assert diff(a, b) == ("--- a\n+++ b\n@@ -1,4 +1,5 @@\n keep\n-old1\n-old2\n+new1\n+new2\n+new3\n keep2\n")


def test_zero_context_pure_insert_and_delete():
    a = ["a", "b", "c", "d", "e"]
    b = ["a", "b", "X", "c", "e"]
    assert diff(a, b, n=0) == ref(a, b, n=0)
    assert "@@ -2,0 +3 @@" in diff(a, b, n=0)
    assert "@@ -4 +4,0 @@" in diff(a, b, n=0)


def test_minimal_where_greedy_matching_is_not():
    a = ["x", "a", "b", "c", "d"]
    b = ["a", "b", "c", "d", "x"]
    patch = diff(a, b)
    check_structure(a, b, patch)
    assert patch.splitlines()[2:] == ["@@ -1,5 +1,5 @@", "-x", " a", " b", " c", " d", "+x"]


def test_random_minimal_and_valid():
    rng = random.Random(2024)
    for _ in range(150):
        a = [rng.choice("abcde") for _ in range(rng.randint(0, 15))]
        b = [rng.choice("abcde") for _ in range(rng.randint(0, 15))]
        patch = diff(a, b, n=rng.randint(0, 3))
        if a == b:
            assert patch == ""
        else:
            check_structure(a, b, patch)


def test_random_unique_lines_match_difflib():
    rng = random.Random(99)
    for _ in range(60):
        base = [f"u{i}" for i in range(rng.randint(0, 40))]
        b = [x for x in base if rng.random() > 0.2]
        for _ in range(rng.randint(0, 5)):
            b.insert(rng.randint(0, len(b)), f"new{rng.randint(0, 10**6)}")
        n = rng.randint(0, 4)
        assert diff(base, b, n=n) == ref(base, b, n=n)


def test_apply_roundtrip():
    rng = random.Random(5)
    for _ in range(100):
        a = [rng.choice("xyz") + str(rng.randint(0, 3)) for _ in range(rng.randint(0, 20))]
        b = [rng.choice("xyz") + str(rng.randint(0, 3)) for _ in range(rng.randint(0, 20))]
        n = rng.randint(0, 3)
        snapshot = list(a)
        assert apply(a, diff(a, b, n=n)) == b
        assert a == snapshot


def test_apply_difflib_patches_and_no_headers():
    rng = random.Random(8)
    for _ in range(60):
        a = [rng.choice("pqrs") for _ in range(rng.randint(0, 25))]
        b = [rng.choice("pqrs") for _ in range(rng.randint(0, 25))]
        n = rng.randint(0, 3)
        patch = ref(a, b, n=n)
        assert apply(a, patch) == b
        if patch:
            headless = "".join(patch.splitlines(keepends=True)[2:])
            assert apply(a, headless) == b
    assert apply(["a"], "") == ["a"]


def test_apply_errors():
    a = ["1", "2", "3", "4"]
    good = diff(a, ["1", "2", "three", "4"])
    with pytest.raises(PatchError, match="hunk 1"):
        apply(["1", "2", "3", "X"], good)
    with pytest.raises(PatchError, match="hunk 1"):
        apply(a, good.replace("@@ -1,4 +1,4 @@", "@@ -1,4 +1,5 @@"))
    with pytest.raises(PatchError, match="line 3"):
        apply(a, "--- a\n+++ b\n@@ bogus @@\n 1\n")
    with pytest.raises(PatchError, match="line 1"):
        apply(a, "garbage\n@@ -1 +1 @@\n-1\n+one\n")
    assert issubclass(PatchError, ValueError)
    two = "@@ -3 +3 @@\n-3\n+x\n@@ -1 +1 @@\n-1\n+y\n"
    with pytest.raises(PatchError, match="hunk 2"):
        apply(a, two)


def test_does_not_import_difflib():
    code = (
        "import sys, linediff\n"
        "p = linediff.diff(['a', 'b'], ['a', 'c'])\n"
        "linediff.apply(['a', 'b'], p)\n"
        "print('difflib' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
