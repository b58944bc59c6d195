"""The Graph class."""

from graphs.errors import EdgeNotFound, NodeNotFound  # noqa: F401


class Graph:
    def __init__(self, directed=False):
        self.directed = directed

    def add_node(self, n):
        raise NotImplementedError

    def add_edge(self, u, v, weight=1):
        raise NotImplementedError

    def remove_edge(self, u, v):
        raise NotImplementedError

    def remove_node(self, n):
        raise NotImplementedError

    def nodes(self):
        raise NotImplementedError

    def edges(self):
        raise NotImplementedError

    def neighbors(self, n):
        raise NotImplementedError

    def has_node(self, n):
        raise NotImplementedError

    def has_edge(self, u, v):
        raise NotImplementedError

    def weight(self, u, v):
        raise NotImplementedError

    def __len__(self):
        raise NotImplementedError

    def __contains__(self, n):
        raise NotImplementedError
