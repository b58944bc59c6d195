"""``python -m gyre_jax.audit <workdir> [--json]``: checks a run directory's invariants after any stop (a clean
end, SIGTERM, or SIGKILL at any point followed by resumes). Exit status 1 with one line per violation (each
saying what to do), 0 if clean.

Invariants (``audit(workdir) -> AuditReport``; docs/records.md, "Auditing a run directory"):
- the latest checkpoint restores: every array of its train state is read back (as saved, on the host: the
  model is not rebuilt) with its JSON meta, whose ``next_step`` is the step it is saved under;
- every completed step (``k < next_step``) has ``results/step_k.jsonl`` holding exactly the executions the
  plan gives it (``run.step_specs`` from the run's ``config.json``); a missing one counts as lost;
- no execution id is trained in two steps (results files and queue entries), none is queued twice;
- the execution queue (``trajectory/queue.jsonl``) parses end to end; a torn last line (a kill mid-append) is
  allowed: its reader never returns an incomplete line and the next append cuts it off (``torn_queue_tail``);
- every trained execution's records (``records/<id>.jsonl``) parse end to end, with no torn line and call
  indices 0..n-1;
- ``metrics.jsonl`` parses; after a ``resume`` entry (written by each resumed attempt) the train entries of
  steps >= its ``next_step`` written before it are superseded (the step ran again); each completed step has
  exactly one train entry left.
Executions of an interrupted attempt are set aside under ``aborted/<time>-<pid>/`` and run again under the same
id and seed; ``set_aside`` counts them (one per aborted directory and id).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gyre_jax.build import make_suite
from gyre_jax.checkpoint import Checkpointer
from gyre_jax.config import RunConfig
from gyre_jax.proxy.records import TitoRecord
from gyre_jax.run import step_specs
from gyre_jax.trajectory.queue import QueuedExecution


@dataclass
class AuditReport:
    """What ``audit`` found in one run directory (JSON form: ``dataclasses.asdict``)."""

    workdir: str
    checkpoint: int | None = None  # the latest checkpoint's step
    next_step: int = 0  # its cursor: steps below it are completed
    total_steps: int = 0  # the config's
    steps_completed: int = 0
    executions_trained: int = 0  # in the completed steps' results
    lost: int = 0  # planned for a completed step, not in its results
    double_counted: int = 0  # trained in two steps, or queued twice
    set_aside: int = 0  # (aborted directory, execution id) pairs
    resumes: int = 0  # resume entries in metrics.jsonl
    superseded_metrics: int = 0  # train entries of a step that ran again after a resume
    uncommitted_results: int = 0  # results/step_k.jsonl with k >= next_step (a killed attempt's; rewritten on rerun)
    torn_queue_tail: bool = False
    records_checked: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def audit(workdir: str | Path) -> AuditReport:
    """Checks ``workdir`` (see the module docstring); never modifies it."""
    workdir = Path(workdir)
    report = AuditReport(workdir=str(workdir))
    config_path = workdir / "config.json"
    if not config_path.is_file():
        report.violations.append(f"{config_path}: missing; is {workdir} a run directory (python -m gyre_jax.train)?")
        return report
    config = RunConfig.from_config_dict(json.loads(config_path.read_text()))
    report.total_steps = config.total_steps
    check_checkpoint(workdir, report)
    trained = check_results(workdir, config, report)
    check_queue(workdir, report)
    check_records(workdir, trained, report)
    check_metrics(workdir, report)
    report.set_aside = count_set_aside(workdir)
    return report


def check_checkpoint(workdir: Path, report: AuditReport) -> None:
    """The latest checkpoint restores, arrays and meta; sets ``checkpoint`` and ``next_step``."""
    directory = workdir / "checkpoints"
    if not directory.is_dir():
        report.violations.append(f"{directory}: no checkpoints; the run never got past its start: run it again")
        return
    ckpt = Checkpointer(directory, max_to_keep=10**6)  # never deletes: saves nothing
    try:
        latest = ckpt.latest_step()
        if latest is None:
            report.violations.append(f"{directory}: no complete checkpoint; run the same command again")
            return
        try:
            state, meta = ckpt.restore_as_saved(latest)
        except Exception as e:  # noqa: BLE001 - reported as the violation it is
            report.violations.append(f"{directory}/{latest}: does not restore ({type(e).__name__}: {e}); delete it")
            return
    finally:
        ckpt.close()
    report.checkpoint, report.next_step = latest, int(meta.get("next_step", -1))
    if report.next_step != latest:
        report.violations.append(f"{directory}/{latest}: meta next_step={report.next_step} is not its step {latest}")
    bad = [k for k, v in _flat(state) if np.issubdtype(v.dtype, np.floating) and not np.all(np.isfinite(v))]
    if bad:
        report.violations.append(f"{directory}/{latest}: non-finite values in {bad[:3]}; resume from an older one")


def check_results(workdir: Path, config: RunConfig, report: AuditReport) -> set[str]:
    """Completed steps' results hold exactly the plan's executions, none in two steps. Returns the trained ids."""
    suite = make_suite(config)
    step_of: dict[str, int] = {}
    for k in range(report.next_step):
        planned = [s.execution_id for s in step_specs(config, suite, k)]
        path = workdir / "results" / f"step_{k:06d}.jsonl"
        if not path.is_file():
            report.lost += len(planned)
            report.violations.append(f"{path}: missing for completed step {k}: its {len(planned)} executions are lost")
            continue
        try:
            got = [json.loads(line)["execution_id"] for line in path.read_text().splitlines()]
        except (ValueError, KeyError) as e:
            report.violations.append(f"{path}: does not parse ({e}); the step's results were damaged")
            continue
        missing, extra = set(planned) - set(got), set(got) - set(planned)
        twice = [eid for eid, n in Counter(got).items() if n > 1]
        report.lost += len(missing)
        report.double_counted += len(twice)
        if missing or extra or twice:
            report.violations.append(
                f"{path}: step {k} should hold its {len(planned)} planned executions once each; missing "
                f"{sorted(missing)[:3]}, unplanned {sorted(extra)[:3]}, twice {twice[:3]}"
            )
        for eid in set(got):
            if eid in step_of:
                report.double_counted += 1
                report.violations.append(f"execution {eid} trained in steps {step_of[eid]} and {k}")
            step_of[eid] = k
        report.steps_completed += 1
    report.executions_trained = len(step_of)
    results = workdir / "results"
    later = [p for p in results.glob("step_*.jsonl") if int(p.stem[5:]) >= report.next_step] if results.is_dir() else []
    report.uncommitted_results = len(later)
    if later and report.next_step >= report.total_steps:
        report.violations.append(f"{later[0]}: results past the finished run's last step; remove them")
    return set(step_of)


def check_queue(workdir: Path, report: AuditReport) -> None:
    """The execution queue parses end to end (a torn last line allowed); no execution queued twice."""
    path = workdir / "trajectory" / "queue.jsonl"
    if not path.is_file():
        return
    seen: Counter[str] = Counter()
    data = path.read_bytes()
    lines = data.split(b"\n")
    report.torn_queue_tail = lines[-1] != b""
    for i, line in enumerate(lines[:-1]):
        try:
            entry = QueuedExecution.from_json(line.decode("utf-8"))
        except (ValueError, TypeError) as e:
            report.violations.append(f"{path}: line {i + 1} does not parse ({e}); the queue was damaged")
            return
        if entry.index != i:
            report.violations.append(f"{path}: line {i + 1} has index {entry.index}; the queue was damaged")
        seen[entry.execution_id] += 1
    twice = [eid for eid, n in seen.items() if n > 1]
    report.double_counted += len(twice)
    if twice:
        report.violations.append(f"{path}: executions queued more than once: {twice[:3]}")


def check_records(workdir: Path, trained: set[str], report: AuditReport) -> None:
    """Every trained execution's TITO records parse end to end: complete lines, call indices 0..n-1."""
    for eid in sorted(trained):
        path = workdir / "records" / f"{eid}.jsonl"
        if not path.is_file():
            continue  # an execution that made no model call (its harness failed first) has no records
        data = path.read_text(encoding="utf-8")
        if data and not data.endswith("\n"):
            report.violations.append(f"{path}: torn last line in a trained execution's records")
            continue
        try:
            calls = sorted(TitoRecord.from_json(line).call_index for line in data.splitlines())
        except (ValueError, TypeError) as e:
            report.violations.append(f"{path}: a record does not parse ({e}); the records were damaged")
            continue
        if calls != list(range(len(calls))):
            report.violations.append(f"{path}: call indices {calls[:8]} are not 0..{len(calls) - 1}")
        report.records_checked += 1


def check_metrics(workdir: Path, report: AuditReport) -> None:
    """metrics.jsonl parses; one train entry per completed step once resumed attempts' reruns are superseded."""
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        return
    train: dict[int, int] = Counter()
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        try:
            m = json.loads(line)
        except ValueError as e:
            report.violations.append(f"{path}: line {i + 1} does not parse ({e})")
            continue
        if m.get("phase") == "resume":
            report.resumes += 1
            for step in [s for s in train if s >= m["next_step"]]:
                report.superseded_metrics += train.pop(step)
        elif m.get("phase") == "train":
            train[m["step"]] += 1
    bad = [k for k in range(report.next_step) if train.get(k, 0) != 1]
    if bad:
        counts = {k: train.get(k, 0) for k in bad[:5]}
        report.violations.append(f"{path}: completed steps without exactly one train entry (step: entries) {counts}")


def count_set_aside(workdir: Path) -> int:
    """(aborted directory, execution id) pairs: executions of interrupted attempts, set aside and run again."""
    pairs = set()
    for attempt in (workdir / "aborted").glob("*"):
        pairs |= {(attempt.name, p.stem) for p in attempt.glob("records/*.jsonl")}
        pairs |= {(attempt.name, p.name) for p in attempt.glob("executions/*")}
    return len(pairs)


def _flat(tree) -> list[tuple[str, np.ndarray]]:
    if isinstance(tree, dict):
        return [(f"{k}.{p}" if p else str(k), v) for k, sub in tree.items() for p, v in _flat(sub)]
    if isinstance(tree, (list, tuple)):
        return [(f"{i}.{p}" if p else str(i), v) for i, sub in enumerate(tree) for p, v in _flat(sub)]
    return [("", np.asarray(tree))] if tree is not None else []


def summary_line(report: AuditReport) -> str:
    r = report
    return (
        f"{r.workdir}: {'ok' if r.ok else 'VIOLATIONS'}; checkpoint {r.checkpoint} (next step {r.next_step}/"
        f"{r.total_steps}), {r.steps_completed} steps, {r.executions_trained} executions trained, lost {r.lost}, "
        f"double counted {r.double_counted}, set aside {r.set_aside}, resumes {r.resumes}, superseded metrics "
        f"{r.superseded_metrics}, torn queue tail {r.torn_queue_tail}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre_jax.audit", description=__doc__.split("\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = audit(args.workdir)
    if args.json:
        print(json.dumps({**dataclasses.asdict(report), "ok": report.ok}, indent=2))
    else:
        print(summary_line(report))
        for v in report.violations:
            print(f"violation: {v}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
