"""Breadth-first and depth-first traversal, connected components."""

from collections import deque

from graphs.errors import NodeNotFound


def bfs(g, start):
    if start not in g:
        raise NodeNotFound(start)
    seen, order, q = {start}, [], deque([start])
    while q:
        n = q.popleft()
        order.append(n)
        for v, _ in g.neighbors(n):
            if v not in seen:
                seen.add(v)
                q.append(v)
    return order


def dfs(g, start):
    if start not in g:
        raise NodeNotFound(start)
    seen, order = {start}, [start]
    stack = [iter(g.neighbors(start))]
    while stack:
        for v, _ in stack[-1]:
            if v not in seen:
                seen.add(v)
                order.append(v)
                stack.append(iter(g.neighbors(v)))
                break
        else:
            stack.pop()
    return order


def connected_components(g):
    und = {n: set() for n in g.nodes()}
    for u, v, _ in g.edges():
        und[u].add(v)
        und[v].add(u)
    comp_of = {}
    comps = []
    for n in g.nodes():
        if n in comp_of:
            continue
        idx = len(comps)
        members = {n}
        comp_of[n] = idx
        stack = [n]
        while stack:
            x = stack.pop()
            for y in und[x]:
                if y not in comp_of:
                    comp_of[y] = idx
                    members.add(y)
                    stack.append(y)
        comps.append(members)
    order = g.nodes()
    return [[n for n in order if n in c] for c in comps]
