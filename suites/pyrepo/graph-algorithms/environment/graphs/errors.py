"""Errors raised by the graphs package."""


class GraphError(Exception):
    """Base class of every error of this package."""


class NodeNotFound(GraphError, KeyError):
    """A node that is not in the graph was named."""


class EdgeNotFound(GraphError, KeyError):
    """An edge that is not in the graph was named."""


class NoPathError(GraphError):
    """The target cannot be reached from the source."""


class CycleError(GraphError):
    """The directed graph has a cycle; ``cycle`` lists it as [n0, ..., nk, n0]."""

    def __init__(self, cycle):
        self.cycle = list(cycle)
        super().__init__("graph has a cycle: " + " -> ".join(map(repr, self.cycle)))
