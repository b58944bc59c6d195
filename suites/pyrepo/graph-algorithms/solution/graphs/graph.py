"""The Graph class."""

from graphs.errors import EdgeNotFound, NodeNotFound


class Graph:
    def __init__(self, directed=False):
        self.directed = directed
        self._adj = {}  # node -> dict(neighbor -> weight), both in insertion order

    def add_node(self, n):
        self._adj.setdefault(n, {})

    def add_edge(self, u, v, weight=1):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
            raise ValueError(f"edge weight must be a number >= 0, got {weight!r}")
        self.add_node(u)
        self.add_node(v)
        self._adj[u][v] = weight
        if not self.directed:
            self._adj[v][u] = weight

    def _need(self, n):
        if n not in self._adj:
            raise NodeNotFound(n)

    def remove_edge(self, u, v):
        if u not in self._adj or v not in self._adj[u]:
            raise EdgeNotFound((u, v))
        del self._adj[u][v]
        if not self.directed and u != v:
            del self._adj[v][u]

    def remove_node(self, n):
        self._need(n)
        del self._adj[n]
        for nbrs in self._adj.values():
            nbrs.pop(n, None)

    def nodes(self):
        return list(self._adj)

    def edges(self):
        out, seen = [], set()
        for u, nbrs in self._adj.items():
            for v, w in nbrs.items():
                if not self.directed:
                    key = frozenset((u, v))
                    if key in seen:
                        continue
                    seen.add(key)
                out.append((u, v, w))
        return out

    def neighbors(self, n):
        self._need(n)
        return list(self._adj[n].items())

    def has_node(self, n):
        return n in self._adj

    def has_edge(self, u, v):
        return u in self._adj and v in self._adj[u]

    def weight(self, u, v):
        if not self.has_edge(u, v):
            raise EdgeNotFound((u, v))
        return self._adj[u][v]

    def __len__(self):
        return len(self._adj)

    def __contains__(self, n):
        return n in self._adj
