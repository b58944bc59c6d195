"""Half-open integer intervals [start, end)."""


def _check(interval):
    if not isinstance(interval, (tuple, list)) or len(interval) != 2:
        raise ValueError(f"an interval is a (start, end) pair, got {interval!r}")
    start, end = interval
    for bound in (start, end):
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise ValueError(f"interval bounds must be ints, got {interval!r}")
    if start >= end:
        raise ValueError(f"interval start must be < end, got {interval!r}")
    return (start, end)


def merge(intervals):
    out = []
    for start, end in sorted(_check(iv) for iv in intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a, b):
    a, b = merge(a), merge(b)
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b):
    a, b = merge(a), merge(b)
    out = []
    for start, end in a:
        cur = start
        for b_start, b_end in b:
            if b_end <= cur:
                continue
            if b_start >= end:
                break
            if b_start > cur:
                out.append((cur, b_start))
            cur = b_end
            if cur >= end:
                break
        if cur < end:
            out.append((cur, end))
    return out


def contains(intervals, point):
    if isinstance(point, bool) or not isinstance(point, int):
        raise ValueError(f"point must be an int, got {point!r}")
    return any(start <= point < end for start, end in merge(intervals))


def total_length(intervals):
    return sum(end - start for start, end in merge(intervals))
