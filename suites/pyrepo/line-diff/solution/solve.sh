#!/usr/bin/env bash
set -euo pipefail
cat > linediff.py <<'EOF'
"""Line diff (LCS) and patch application. Does not import difflib."""

import re

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    pass


def _lcs_pairs(a, b):
    """Matched index pairs (i, j) of one longest common subsequence, increasing."""
    pre = 0
    while pre < len(a) and pre < len(b) and a[pre] == b[pre]:
        pre += 1
    suf = 0
    while suf < len(a) - pre and suf < len(b) - pre and a[-1 - suf] == b[-1 - suf]:
        suf += 1
    A, B = a[pre:len(a) - suf], b[pre:len(b) - suf]
    n, m = len(A), len(B)
    L = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        Li, Li1, ai = L[i], L[i + 1], A[i]
        for j in range(m - 1, -1, -1):
            if ai == B[j]:
                Li[j] = Li1[j + 1] + 1
            else:
                x, y = Li1[j], Li[j + 1]
                Li[j] = x if x >= y else y
    pairs = [(k, k) for k in range(pre)]
    i = j = 0
    while i < n and j < m:
        if A[i] == B[j]:
            pairs.append((pre + i, pre + j))
            i += 1
            j += 1
        elif L[i + 1][j] >= L[i][j + 1]:
            i += 1
        else:
            j += 1
    pairs += [(len(a) - suf + k, len(b) - suf + k) for k in range(suf)]
    return pairs


def _opcodes(a, b):
    """[(tag, i1, i2, j1, j2)] with tag 'equal' or 'change', covering both sequences."""
    ops, i, j = [], 0, 0
    for x, y in _lcs_pairs(a, b) + [(len(a), len(b))]:
        if x > i or y > j:
            ops.append(("change", i, x, j, y))
        if x < len(a):
            if ops and ops[-1][0] == "equal":
                t, i1, _, j1, _ = ops[-1]
                ops[-1] = (t, i1, x + 1, j1, y + 1)
            else:
                ops.append(("equal", x, x + 1, y, y + 1))
        i, j = x + 1, y + 1
    return ops


def _groups(ops, n):
    if not ops:
        ops = [("equal", 0, 1, 0, 1)]
    if ops[0][0] == "equal":
        t, i1, i2, j1, j2 = ops[0]
        ops[0] = (t, max(i1, i2 - n), i2, max(j1, j2 - n), j2)
    if ops[-1][0] == "equal":
        t, i1, i2, j1, j2 = ops[-1]
        ops[-1] = (t, i1, min(i2, i1 + n), j1, min(j2, j1 + n))
    group, out = [], []
    for t, i1, i2, j1, j2 in ops:
        if t == "equal" and i2 - i1 > 2 * n:
            group.append((t, i1, min(i2, i1 + n), j1, min(j2, j1 + n)))
            out.append(group)
            group = []
            i1, j1 = max(i1, i2 - n), max(j1, j2 - n)
        group.append((t, i1, i2, j1, j2))
    if group and not (len(group) == 1 and group[0][0] == "equal"):
        out.append(group)
    return out


def _range(start, stop):
    length = stop - start
    if length == 1:
        return f"{start + 1}"
    if length == 0:
        return f"{start},0"
    return f"{start + 1},{length}"


def diff(a, b, n=3, fromfile="a", tofile="b"):
    a, b = list(a), list(b)
    if a == b:
        return ""
    out = [f"--- {fromfile}", f"+++ {tofile}"]
    for group in _groups(_opcodes(a, b), n):
        first, last = group[0], group[-1]
        out.append(f"@@ -{_range(first[1], last[2])} +{_range(first[3], last[4])} @@")
        for t, i1, i2, j1, j2 in group:
            if t == "equal":
                out.extend(" " + s for s in a[i1:i2])
            else:
                out.extend("-" + s for s in a[i1:i2])
                out.extend("+" + s for s in b[j1:j2])
    return "\n".join(out) + "\n"


def _parse(patch):
    lines = patch.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    hunks, k = [], 0
    if len(lines) >= 2 and lines[0].startswith("---") and lines[1].startswith("+++"):
        k = 2
    while k < len(lines):
        m = _HUNK.match(lines[k])
        if not m:
            raise PatchError(f"line {k + 1}: expected a hunk header '@@ -S,L +S,L @@', got {lines[k]!r}")
        s1, l1, s2, l2 = (int(g) if g is not None else 1 for g in m.groups())
        body = []
        k += 1
        while k < len(lines) and lines[k][:1] in (" ", "-", "+") and not lines[k].startswith("@@"):
            body.append(lines[k])
            k += 1
        hunks.append((s1, l1, s2, l2, body))
    return hunks


def apply(a, patch):
    if patch == "":
        return list(a)
    out, pos = [], 0
    for num, (s1, l1, _s2, l2, body) in enumerate(_parse(patch), start=1):
        old = [x[1:] for x in body if x[0] in " -"]
        new = [x[1:] for x in body if x[0] in " +"]
        if len(old) != l1 or len(new) != l2:
            raise PatchError(f"hunk {num}: header says -{l1} +{l2} lines, body has -{len(old)} +{len(new)}")
        start = s1 if l1 == 0 else s1 - 1
        if start < pos:
            raise PatchError(f"hunk {num}: starts at line {s1}, before the end of the previous hunk")
        if start > len(a) or a[start:start + l1] != old:
            raise PatchError(f"hunk {num}: context does not match the file at line {s1}")
        out.extend(a[pos:start])
        out.extend(new)
        pos = start + l1
    out.extend(a[pos:])
    return out
EOF
