"""A small graph library (see instruction.md)."""

from graphs.errors import CycleError, EdgeNotFound, GraphError, NodeNotFound, NoPathError
from graphs.graph import Graph

__all__ = ["CycleError", "EdgeNotFound", "Graph", "GraphError", "NoPathError", "NodeNotFound"]
