"""Reports the largest classes and functions in gyre_jax/ (lines from the def/class line, decorators included,
through the last line): where the code grows, for reading, not a limit to meet. Cohesion decides where code lives.

    python scripts/check_sizes.py [--top 12]

Always exits 0 (tests/test_code_style.py runs it so that it keeps working; CI never fails on a size).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sizes(path: Path):
    """``(node, lines)`` for every class and function of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node, node.end_lineno - start + 1


def report(top: int) -> str:
    """The ``top`` longest classes and functions, each kind with its count and median length."""
    rows = {"classes": [], "functions": []}
    for path in sorted((ROOT / "gyre_jax").rglob("*.py")):
        for node, n in sizes(path):
            kind = "classes" if isinstance(node, ast.ClassDef) else "functions"
            rows[kind].append((n, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    out = []
    for kind, found in rows.items():
        found.sort(key=lambda r: (-r[0], r[1]))
        median = sorted(n for n, _ in found)[len(found) // 2] if found else 0
        out.append(f"{len(found)} {kind} in gyre_jax/ (median {median} lines); the {min(top, len(found))} longest:")
        out += [f"  {n:5d}  {where}" for n, where in found[:top]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=12, help="how many of each kind to list")
    args = parser.parse_args(argv)
    print(report(args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
