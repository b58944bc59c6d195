"""Fault and abuse suite, long versions: each case injects its faults, checks what was lost or counted twice,
and reports one row per fault (docs/reliability.md is this table).

Cases live in ``benchmarks/faults/<case>.py``; each exposes ``run(quick, seed, workdir) -> {"rows": [...],
"extra": {...}}`` where a row is ``{"fault", "injected", "lost", "double_counted", "outcome", "printed",
"command", "needs"}`` (``outcome`` is "ok" or "fails"). ``--quick`` runs the CI-size version of every case
(tests/faults/ runs the same code paths with assertions).

    python benchmarks/bench_faults.py                      # every case, long versions -> benchmarks/results/faults.json
    python benchmarks/bench_faults.py --case overload --quick --out /tmp/faults_overload.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES_DIR = ROOT / "benchmarks" / "faults"
ROW_KEYS = ("fault", "injected", "lost", "double_counted", "outcome", "printed", "command", "needs")


def available_cases() -> list[str]:
    """The case modules under benchmarks/faults/, by file name."""
    return sorted(p.stem for p in CASES_DIR.glob("*.py") if not p.stem.startswith("_"))


def load_case(name: str):
    """The module ``benchmarks/faults/<name>.py`` (loaded by path: benchmarks/ is not a package)."""
    path = CASES_DIR / f"{name}.py"
    if not path.exists():
        raise SystemExit(f"error: no fault case {name!r}; the cases are {', '.join(available_cases())}")
    spec = importlib.util.spec_from_file_location(f"gyre_fault_case_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def check_rows(case: str, rows: list[dict]) -> list[dict]:
    """The case's rows, each with exactly the documented keys (a missing key is a bug in the case)."""
    for row in rows:
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"case {case}: row {row.get('fault', row)!r} lacks {missing}")
        if row["outcome"] not in ("ok", "fails"):
            raise ValueError(f"case {case}: row {row['fault']!r} has outcome {row['outcome']!r} (ok | fails)")
    return rows


def run_case(name: str, quick: bool, seed: int) -> dict:
    """One case's result; a case that raises is reported as one failing row (the run goes on)."""
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix=f"gyre-faults-{name}-") as tmp:
        try:
            out = load_case(name).run(quick=quick, seed=seed, workdir=Path(tmp))
            rows, extra = check_rows(name, out["rows"]), out.get("extra", {})
        except Exception as exc:  # noqa: BLE001 - a broken case is a row, not the end of the suite
            traceback.print_exc()
            rows = [{"fault": f"{name} (case raised)", "injected": 0, "lost": 0, "double_counted": 0,
                     "outcome": "fails", "printed": f"{type(exc).__name__}: {exc}"[:300],
                     "command": f"python benchmarks/bench_faults.py --case {name}", "needs": "a fix of the case"}]  # fmt: skip
            extra = {}
    return {"case": name, "quick": quick, "seconds": round(time.time() - t0, 1), "rows": rows, "extra": extra}


def print_table(results: list[dict]) -> None:
    header = f"{'case':<10} {'fault':<44} {'injected':>8} {'lost':>5} {'double':>6}  outcome  printed"
    print(header)
    print("-" * len(header))
    for res in results:
        for r in res["rows"]:
            printed = r["printed"].replace("\n", " ")[:70]
            print(f"{res['case']:<10} {r['fault'][:44]:<44} {r['injected']:>8} {r['lost']:>5} "
                  f"{r['double_counted']:>6}  {r['outcome']:<7}  {printed}")  # fmt: skip


def _cell(text: str) -> str:
    """``text`` as one markdown table cell (pipes escaped, one line)."""
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(results: list[dict]) -> str:
    """The rows as the table of docs/reliability.md."""
    lines = ["| case | fault | injected | lost | double-counted | outcome | what it printed | reproduce |",
             "|---|---|---:|---:|---:|---|---|---|"]  # fmt: skip
    for res in results:
        for r in res["rows"]:
            outcome = r["outcome"] if not r["needs"] else f"{r['outcome']} (needs {r['needs']})"
            printed = _cell(r["printed"])[:160]
            lines.append(f"| {res['case']} | {_cell(r['fault'])} | {r['injected']} | {r['lost']} | {r['double_counted']} "
                         f"| {outcome} | {printed} | `{r['command']}` |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="all", help=f"one of {available_cases()} or all")
    ap.add_argument("--quick", action="store_true", help="the CI-size version of each case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", help="also write the rows as a markdown table to this file")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults.json"))
    args = ap.parse_args(argv)
    cases = available_cases() if args.case == "all" else [args.case]
    results = [run_case(name, args.quick, args.seed) for name in cases]
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "time": time.time()}
    out.write_text(json.dumps({"meta": meta, "seed": args.seed, "cases": results}, indent=1) + "\n")
    print(f"wrote {out}")
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(results))
        print(f"wrote {args.markdown}")
    failing = sum(r["outcome"] == "fails" for res in results for r in res["rows"])
    lost = sum(r["lost"] + r["double_counted"] for res in results for r in res["rows"])
    return 1 if failing or lost else 0


if __name__ == "__main__":
    sys.exit(main())
