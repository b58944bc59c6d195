"""Topological sort and cycle detection."""

import heapq

from graphs.errors import CycleError, GraphError


def _need_directed(g):
    if not g.directed:
        raise GraphError("topological order needs a directed graph; build it with Graph(directed=True)")


def _find_cycle(g, candidates):
    """A directed cycle among `candidates` (nodes left after Kahn's algorithm)."""
    color = {}
    for root in g.nodes():
        if root not in candidates or root in color:
            continue
        color[root] = 1
        path = [root]
        stack = [iter(g.neighbors(root))]
        while stack:
            for v, _ in stack[-1]:
                if v not in candidates:
                    continue
                if color.get(v) == 1:
                    i = path.index(v)
                    return path[i:] + [v]
                if v not in color:
                    color[v] = 1
                    path.append(v)
                    stack.append(iter(g.neighbors(v)))
                    break
            else:
                stack.pop()
                color[path.pop()] = 2
    raise AssertionError("no cycle found among the remaining nodes")


def topological_sort(g):
    _need_directed(g)
    nodes = g.nodes()
    pos = {n: i for i, n in enumerate(nodes)}
    indeg = {n: 0 for n in nodes}
    for _, v, _ in g.edges():
        indeg[v] += 1
    heap = [pos[n] for n in nodes if indeg[n] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        n = nodes[heapq.heappop(heap)]
        order.append(n)
        for v, _ in g.neighbors(n):
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, pos[v])
    if len(order) < len(nodes):
        placed = set(order)
        raise CycleError(_find_cycle(g, {n for n in nodes if n not in placed}))
    return order


def has_cycle(g):
    try:
        topological_sort(g)
    except CycleError:
        return True
    return False
