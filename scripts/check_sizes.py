"""Lists classes over 300 lines and functions over 60 lines in gyre_jax/ (def/class line through the last line).

    python scripts/check_sizes.py [--max-class 300] [--max-function 60]

Exit status 1 when any is over (CI runs it; docs/architecture.md names the exceptions, if any).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sizes(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node, node.end_lineno - start + 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-class", type=int, default=300)
    parser.add_argument("--max-function", type=int, default=60)
    args = parser.parse_args()
    over = []
    for path in sorted((ROOT / "gyre_jax").rglob("*.py")):
        for node, n in sizes(path):
            limit = args.max_class if isinstance(node, ast.ClassDef) else args.max_function
            if n > limit:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                over.append((n, f"{path.relative_to(ROOT)}:{node.lineno} {kind} {node.name}: {n} lines (> {limit})"))
    for _, line in sorted(over, reverse=True):
        print(line)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
