"""A small graph library."""

from graphs.errors import CycleError, EdgeNotFound, GraphError, NodeNotFound, NoPathError
from graphs.graph import Graph
from graphs.paths import dijkstra, shortest_path
from graphs.topo import has_cycle, topological_sort
from graphs.traversal import bfs, connected_components, dfs

__all__ = [
    "CycleError",
    "EdgeNotFound",
    "Graph",
    "GraphError",
    "NoPathError",
    "NodeNotFound",
    "bfs",
    "connected_components",
    "dfs",
    "dijkstra",
    "has_cycle",
    "shortest_path",
    "topological_sort",
]
