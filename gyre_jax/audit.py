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
  exactly one train entry left;
- the metrics agree with the results: each completed step's train entry counts the executions, exclusions, crashes
  and refused model calls its ``results/step_k.jsonl`` holds, and trains no more executions than the execution queue
  gave the trainer (entries of weight > 0 whose records exist).
What was trained is said apart from what ran: ``executions_run`` (in the completed steps' results) and
``executions_trained`` (with tokens in a micro-batch: the train entries' ``executions_trained``), with the executions
the pipeline left out and the model calls the proxy refused, by why.
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
    executions_run: int = 0  # in the completed steps' results
    executions_trained: int | None = None  # with tokens in a micro-batch (metrics; None: metrics that do not say)
    tokens_trained: int = 0  # target tokens of the completed steps' micro-batches (metrics)
    left_out: dict[str, int] = field(default_factory=dict)  # executions the pipeline did not train on, by why
    refused_calls: dict[str, int] = field(default_factory=dict)  # model calls the proxy refused, by why (results)
    crashed: int = 0  # executions whose harness crashed (results)
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
    results = check_results(workdir, config, report)
    given = check_queue(workdir, report)
    check_records(workdir, {eid for step in results.values() for eid in step}, report)
    entries = check_metrics(workdir, report)
    check_metrics_agree(entries, results, given, workdir, report)
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


def check_results(workdir: Path, config: RunConfig, report: AuditReport) -> dict[int, dict[str, dict]]:
    """Completed steps' results hold exactly the plan's executions, none in two steps. Returns each completed step's
    results that parse (execution id -> result dict)."""
    suite = make_suite(config)
    step_of: dict[str, int] = {}
    by_step: dict[int, dict[str, dict]] = {}
    for k in range(report.next_step):
        planned = [s.execution_id for s in step_specs(config, suite, k)]
        path = workdir / "results" / f"step_{k:06d}.jsonl"
        if not path.is_file():
            report.lost += len(planned)
            report.violations.append(f"{path}: missing for completed step {k}: its {len(planned)} executions are lost")
            continue
        try:
            lines = [json.loads(line) for line in path.read_text().splitlines()]
            got = [line["execution_id"] for line in lines]
        except (ValueError, KeyError, TypeError) as e:
            report.violations.append(f"{path}: does not parse ({e}); the step's results were damaged")
            continue
        by_step[k] = {line["execution_id"]: line for line in lines}
        report.crashed += sum(line.get("status") == "crashed" for line in lines)
        for line in lines:
            for kind, n in (line.get("refused_calls") or {}).items():
                report.refused_calls[kind] = report.refused_calls.get(kind, 0) + int(n)
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
    report.executions_run = len(step_of)
    results = workdir / "results"
    later = [p for p in results.glob("step_*.jsonl") if int(p.stem[5:]) >= report.next_step] if results.is_dir() else []
    report.uncommitted_results = len(later)
    if later and report.next_step >= report.total_steps:
        report.violations.append(f"{later[0]}: results past the finished run's last step; remove them")
    return by_step


def check_queue(workdir: Path, report: AuditReport) -> dict[int, set[str]]:
    """The execution queue parses end to end (a torn last line allowed); no execution queued twice. Returns, per
    step, the executions it gave the trainer: weight > 0 and a record file that is not empty."""
    path = workdir / "trajectory" / "queue.jsonl"
    given: dict[int, set[str]] = {}
    if not path.is_file():
        return given
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
        records = workdir / "records" / f"{entry.execution_id}.jsonl"
        if entry.weight > 0 and records.is_file() and records.stat().st_size > 0:
            given.setdefault(entry.step, set()).add(entry.execution_id)
    twice = [eid for eid, n in seen.items() if n > 1]
    report.double_counted += len(twice)
    if twice:
        report.violations.append(f"{path}: executions queued more than once: {twice[:3]}")
    return given


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


def check_metrics(workdir: Path, report: AuditReport) -> dict[int, dict]:
    """metrics.jsonl parses; one train entry per completed step once resumed attempts' reruns are superseded.
    Returns the completed steps' surviving train entries (step -> entry)."""
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        return {}
    train: dict[int, list[dict]] = {}
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        try:
            m = json.loads(line)
        except ValueError as e:
            report.violations.append(f"{path}: line {i + 1} does not parse ({e})")
            continue
        if m.get("phase") == "resume":
            report.resumes += 1
            for step in [s for s in train if s >= m["next_step"]]:
                report.superseded_metrics += len(train.pop(step))
        elif m.get("phase") == "train":
            train.setdefault(m["step"], []).append(m)
    bad = [k for k in range(report.next_step) if len(train.get(k, [])) != 1]
    if bad:
        counts = {k: len(train.get(k, [])) for k in bad[:5]}
        report.violations.append(f"{path}: completed steps without exactly one train entry (step: entries) {counts}")
    return {k: entries[0] for k, entries in train.items() if k < report.next_step and len(entries) == 1}


# (metrics key, what it counts in a step's results) for ``check_metrics_agree``
_RESULT_COUNTS = (
    ("executions", lambda rs: len(rs)),
    ("excluded", lambda rs: sum(bool(r.get("excluded")) for r in rs)),
    ("crashed", lambda rs: sum(r.get("status") == "crashed" for r in rs)),
    *(
        (f"refused_{kind}", lambda rs, kind=kind: sum((r.get("refused_calls") or {}).get(kind, 0) for r in rs))
        for kind in ("context", "admission", "bad_request")
    ),
)


def check_metrics_agree(
    entries: dict[int, dict], results: dict[int, dict[str, dict]], given: dict[int, set[str]], workdir: Path,
    report: AuditReport,
) -> None:  # fmt: skip
    """Each completed step's train entry counts what its results hold (executions, exclusions, crashes, refused
    calls; a key the entry lacks, from an older run, is not compared) and trains no more executions than the queue
    gave the trainer; sums what was trained and left out into the report."""
    path = workdir / "metrics.jsonl"
    trained = [m["executions_trained"] for m in entries.values() if "executions_trained" in m]
    report.executions_trained = sum(trained) if trained else None
    for step, m in sorted(entries.items()):
        report.tokens_trained += int(m.get("tokens_trained", 0) or 0)
        for key, n in m.items():
            if key.startswith("left_out/") and n:
                kind = key.removeprefix("left_out/")
                report.left_out[kind] = report.left_out.get(kind, 0) + int(n)
        rs = list(results.get(step, {}).values())
        if step in results:
            wrong = {key: (m[key], count(rs)) for key, count in _RESULT_COUNTS if key in m and m[key] != count(rs)}
            if wrong:
                report.violations.append(
                    f"{path}: step {step}'s train entry disagrees with results/step_{step:06d}.jsonl (metrics, "
                    f"results): {wrong}"
                )
        if m.get("executions_trained", 0) > len(given.get(step, ())):
            report.violations.append(
                f"{path}: step {step} trained {m['executions_trained']} executions but the execution queue gave the "
                f"trainer {len(given.get(step, ()))} (weight > 0, with records)"
            )


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


def _named(counts: dict[str, int]) -> str:
    named = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in sorted(counts.items()) if n)
    return f"{sum(counts.values())} ({named})" if named else "0"


def summary_line(report: AuditReport) -> str:
    r = report
    trained = "unknown (metrics without executions_trained)" if r.executions_trained is None else r.executions_trained
    return (
        f"{r.workdir}: {'ok' if r.ok else 'VIOLATIONS'}; checkpoint {r.checkpoint} (next step {r.next_step}/"
        f"{r.total_steps}), {r.steps_completed} steps, {r.executions_run} executions run, {trained} trained "
        f"({r.tokens_trained} tokens), crashed {r.crashed}, left out {_named(r.left_out)}, refused calls "
        f"{_named(r.refused_calls)}, lost {r.lost}, double counted {r.double_counted}, set aside {r.set_aside}, "
        f"resumes {r.resumes}, superseded metrics {r.superseded_metrics}, torn queue tail {r.torn_queue_tail}"
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
