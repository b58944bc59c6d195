"""Dijkstra's shortest paths."""

import heapq
import itertools

from graphs.errors import NodeNotFound, NoPathError


def dijkstra(g, source):
    if source not in g:
        raise NodeNotFound(source)
    dist, prev = {source: 0}, {}
    done = set()
    tie = itertools.count()
    heap = [(0, next(tie), source)]
    while heap:
        d, _, u = heapq.heappop(heap)
        if u in done:
            continue
        done.add(u)
        for v, w in g.neighbors(u):
            nd = d + w
            if v not in dist or nd < dist[v]:
                dist[v] = nd
                prev[v] = u
                heapq.heappush(heap, (nd, next(tie), v))
    return dist, prev


def shortest_path(g, source, target):
    if target not in g:
        raise NodeNotFound(target)
    dist, prev = dijkstra(g, source)
    if target not in dist:
        raise NoPathError(f"no path from {source!r} to {target!r}")
    path = [target]
    while path[-1] != source:
        path.append(prev[path[-1]])
    return dist[target], path[::-1]
