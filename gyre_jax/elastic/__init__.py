"""Cells and scheduling policies (colocated now; async and elastic next)."""
