import heapq
import random

import graphs
import pytest
from graphs import (
    CycleError,
    EdgeNotFound,
    Graph,
    GraphError,
    NodeNotFound,
    NoPathError,
    bfs,
    connected_components,
    dfs,
    dijkstra,
    has_cycle,
    shortest_path,
    topological_sort,
)


def make(edges, directed=False, nodes=()):
    g = Graph(directed=directed)
    for n in nodes:
        g.add_node(n)
    for e in edges:
        g.add_edge(*e)
    return g


def assert_valid_cycle(g, cycle):
    assert len(cycle) >= 2 and cycle[0] == cycle[-1]
    for a, b in zip(cycle, cycle[1:]):
        assert g.has_edge(a, b), (a, b, cycle)


def test_graph_basics_undirected():
    g = make([("a", "b", 2), ("b", "c"), ("a", "c", 5)])
    assert g.nodes() == ["a", "b", "c"]
    assert len(g) == 3 and "b" in g and "z" not in g
    assert g.neighbors("b") == [("a", 2), ("c", 1)]
    assert g.has_edge("c", "b") and g.weight("c", "a") == 5
    assert g.edges() == [("a", "b", 2), ("a", "c", 5), ("b", "c", 1)]
    assert g.directed is False


def test_graph_replace_weight_keeps_position_and_removals():
    g = make([(1, 2), (1, 3), (3, 4)], directed=True)
    g.add_edge(1, 2, 9)
    assert g.neighbors(1) == [(2, 9), (3, 1)]
    g.remove_edge(1, 2)
    assert not g.has_edge(1, 2) and g.has_node(2)
    g.remove_node(3)
    assert g.nodes() == [1, 2, 4]
    assert g.edges() == []
    with pytest.raises(EdgeNotFound):
        g.remove_edge(1, 2)
    with pytest.raises(NodeNotFound):
        g.remove_node(3)
    with pytest.raises(KeyError):
        g.neighbors(3)
    with pytest.raises(EdgeNotFound):
        g.weight(1, 4)


def test_graph_weight_validation_and_self_loop():
    g = Graph()
    for bad in (-1, True, "3"):
        with pytest.raises(ValueError):
            g.add_edge("x", "y", bad)
    g.add_edge("x", "x", 0.5)
    assert g.edges() == [("x", "x", 0.5)]
    g.remove_edge("x", "x")
    assert g.edges() == []


def test_bfs_order():
    g = make([(1, 2), (1, 3), (2, 4), (3, 4), (4, 5), (3, 6)])
    assert bfs(g, 1) == [1, 2, 3, 4, 6, 5]
    assert bfs(g, 5) == [5, 4, 2, 3, 1, 6]
    dg = make([("a", "b"), ("c", "a")], directed=True)
    assert bfs(dg, "a") == ["a", "b"]
    with pytest.raises(NodeNotFound):
        bfs(g, 99)


def test_dfs_preorder_matches_recursive():
    g = make([(1, 2), (1, 3), (2, 4), (3, 4), (4, 5), (3, 6)])
    assert dfs(g, 1) == [1, 2, 4, 3, 6, 5]
    rng = random.Random(3)
    dg = Graph(directed=True)
    for _ in range(200):
        dg.add_edge(rng.randint(0, 40), rng.randint(0, 40))

    def rec(n, seen, out):
        seen.add(n)
        out.append(n)
        for v, _ in dg.neighbors(n):
            if v not in seen:
                rec(v, seen, out)
        return out

    for s in dg.nodes()[:10]:
        assert dfs(dg, s) == rec(s, set(), [])


def test_dfs_long_path_no_recursion_limit():
    g = Graph(directed=True)
    for i in range(100_000):
        g.add_edge(i, i + 1)
    order = dfs(g, 0)
    assert len(order) == 100_001 and order[-1] == 100_000


def test_connected_components():
    g = make([("d", "e"), ("a", "b"), ("c", "a")], nodes=["z"])
    assert connected_components(g) == [["z"], ["d", "e"], ["a", "b", "c"]]
    dg = make([(3, 1), (2, 1), (4, 5)], directed=True)
    assert connected_components(dg) == [[3, 1, 2], [4, 5]]
    assert connected_components(Graph()) == []


def test_dijkstra_distances():
    g = make([("s", "a", 1), ("a", "b", 2), ("s", "b", 5), ("b", "t", 1), ("a", "t", 7)], directed=True)
    g.add_node("lonely")
    dist, prev = dijkstra(g, "s")
    assert dist == {"s": 0, "a": 1, "b": 3, "t": 4}
    assert prev == {"a": "s", "b": "a", "t": "b"}


def test_shortest_path_unique():
    g = make([("s", "a", 1), ("a", "b", 2), ("s", "b", 5), ("b", "t", 1), ("a", "t", 7)])
    assert shortest_path(g, "s", "t") == (4, ["s", "a", "b", "t"])
    assert shortest_path(g, "t", "s") == (4, ["t", "b", "a", "s"])
    assert shortest_path(g, "a", "a") == (0, ["a"])


def test_shortest_path_errors():
    g = make([(1, 2)], directed=True, nodes=[3])
    with pytest.raises(NoPathError):
        shortest_path(g, 2, 1)
    with pytest.raises(NoPathError):
        shortest_path(g, 1, 3)
    with pytest.raises(NodeNotFound):
        shortest_path(g, 1, 4)
    with pytest.raises(NodeNotFound):
        shortest_path(g, 4, 1)


def _ref_dists(n, edges, src):
    adj = {i: [] for i in range(n)}
    for u, v, w in edges:
        adj[u].append((v, w))
    dist = {src: 0}
    heap = [(0, src)]
    while heap:
        d, u = heapq.heappop(heap)
        if d > dist[u]:
            continue
        for v, w in adj[u]:
            if v not in dist or d + w < dist[v]:
                dist[v] = d + w
                heapq.heappush(heap, (d + w, v))
    return dist


def test_shortest_paths_random_with_ties():
    rng = random.Random(11)
    for _ in range(30):
        n = rng.randint(2, 25)
        g = Graph(directed=True)
        for i in range(n):
            g.add_node(i)
        edges = {}
        for _ in range(rng.randint(0, 80)):
            edges[(rng.randrange(n), rng.randrange(n))] = rng.randint(0, 4)
        for (u, v), w in edges.items():
            g.add_edge(u, v, w)
        ref = _ref_dists(n, [(u, v, w) for (u, v), w in edges.items()], 0)
        dist, prev = dijkstra(g, 0)
        assert dist == ref
        for t in range(n):
            if t not in ref:
                with pytest.raises(NoPathError):
                    shortest_path(g, 0, t)
                continue
            cost, path = shortest_path(g, 0, t)
            assert cost == ref[t] and path[0] == 0 and path[-1] == t
            assert sum(g.weight(a, b) for a, b in zip(path, path[1:])) == cost


def test_topological_sort_insertion_order_ties():
    g = make(
        [
            ("shirt", "tie"),
            ("tie", "jacket"),
            ("pants", "shoes"),
            ("pants", "belt"),
            ("belt", "jacket"),
            ("socks", "shoes"),
        ],
        directed=True,
        nodes=["watch"],
    )
    assert topological_sort(g) == ["watch", "shirt", "tie", "pants", "belt", "jacket", "socks", "shoes"]
    assert has_cycle(g) is False


def test_topological_sort_respects_edges_random():
    rng = random.Random(5)
    for _ in range(20):
        n = rng.randint(1, 30)
        perm = list(range(n))
        rng.shuffle(perm)
        g = Graph(directed=True)
        for x in rng.sample(range(n), n):
            g.add_node(x)
        for _ in range(rng.randint(0, 60)):
            i, j = sorted(rng.sample(range(n), 2)) if n > 1 else (0, 0)
            if i != j:
                g.add_edge(perm[i], perm[j])
        order = topological_sort(g)
        assert sorted(order) == list(range(n))
        pos = {x: k for k, x in enumerate(order)}
        assert all(pos[u] < pos[v] for u, v, _ in g.edges())


def test_cycle_error_lists_a_cycle():
    g = make([("a", "b"), ("b", "c"), ("c", "d"), ("d", "b"), ("x", "a"), ("d", "e")], directed=True)
    with pytest.raises(CycleError) as ei:
        topological_sort(g)
    cyc = ei.value.cycle
    assert_valid_cycle(g, cyc)
    assert set(cyc) == {"b", "c", "d"}
    assert "'b'" in str(ei.value) or "b" in str(ei.value)
    assert isinstance(ei.value, GraphError)
    assert has_cycle(g) is True


def test_cycle_self_loop_and_downstream_nodes():
    g = make([(1, 2), (2, 3), (3, 3), (3, 4), (4, 5)], directed=True)
    with pytest.raises(CycleError) as ei:
        topological_sort(g)
    assert ei.value.cycle == [3, 3]
    rng = random.Random(9)
    for _ in range(20):
        g = Graph(directed=True)
        for _ in range(40):
            g.add_edge(rng.randint(0, 15), rng.randint(0, 15))
        try:
            topological_sort(g)
        except CycleError as e:
            assert_valid_cycle(g, e.cycle)


def test_topological_sort_undirected_rejected():
    g = make([(1, 2)])
    with pytest.raises(GraphError):
        topological_sort(g)
    with pytest.raises(GraphError):
        has_cycle(g)


def test_package_exports():
    for name in [
        "Graph",
        "bfs",
        "dfs",
        "connected_components",
        "dijkstra",
        "shortest_path",
        "topological_sort",
        "has_cycle",
        "CycleError",
        "NoPathError",
        "NodeNotFound",
    ]:
        assert hasattr(graphs, name), name
    import importlib

    for mod in ("graphs.graph", "graphs.traversal", "graphs.paths", "graphs.topo"):
        importlib.import_module(mod)
