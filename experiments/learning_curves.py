"""Learning curves of one config over N seeds: training reward per step and evaluation before / after RL, each as
the mean over seeds with a 95% bootstrap interval, and the evaluation gain (after - before) with its interval.

Usage:
    python experiments/learning_curves.py --config configs/tiny_cpu.py --seeds 3 [--steps 40] [--config.a.b=value ...]
    python experiments/learning_curves.py --analyze-only --runs-dir runs/learning_curves/tiny_cpu

Runs the config once per seed (seeds ``--first-seed`` .. ``--first-seed + N - 1``), sequentially, each in its own
workdir ``<runs-dir>/seed<k>`` (default runs-dir: ``runs/learning_curves/<config>``, git-ignored), as
``python -m gyre_jax.train --config CONFIG --config.seed=k --config.workdir=...`` (``--steps`` and every
``--config.x=y`` pass through). For the real model: ``--config configs/smollm2_cpu.py --seeds 3`` (each seed
evaluates both splits before RL and every ``eval.every_steps``; docs/tasks.md, "The `smol` suite"). A seed whose run is complete is not run again, and an
interrupted one resumes from its checkpoint (the same command). Then reads each ``metrics.jsonl`` (and, where
present, ``results/eval_<step>.jsonl``) and writes ``learning_curves.json`` and ``learning_curves.png`` into
``--out``, and prints the gains. The result is made of every seed found: this invocation's, any other run directory
``seed<k>`` under the runs-dir, and the seeds an earlier ``learning_curves.json`` in ``--out`` recorded (``runs``:
each seed's curves and per-execution evaluation rewards), so seeds run in different sessions add up even where
their run directories are gone (``gather_runs`` prints where each came from). Each seed run here also records its wall time and the machine's 1-minute load
average over it (``wall_s``, ``load_avg_1min``: these machines are shared, and a time means little without it).

Statistics (``curves`` / ``eval_gains``, pure functions of the runs' metrics):
- training reward (and pass rate) at step s: mean over seeds of the step's reward_mean (pass_rate); interval:
  percentile bootstrap over seeds.
- evaluation curves (``eval_curves``, the table ``learning_curves.md``): per split and evaluated step, the mean over
  seeds of the evaluation reward (the pass rate for 0/1 rewards), bootstrap over seeds.
- evaluation, per split (``train``: the training tasks, ``heldout``: tasks never trained on): before = the
  evaluation after 0 RL steps, after = the one after the last step; gain = after - before per seed. Interval:
  a two-level bootstrap (resample seeds, then each resampled seed's evaluation executions, before and after
  independently) when the per-execution results are present, so it covers both seed-to-seed variation and the
  sampling noise of a finite evaluation; with the metrics alone, a bootstrap over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CONFIDENCE = 0.95
SPLITS = ("train", "heldout")
TRAIN_METRICS = ("grad_norm", "clip_fraction")  # per-step learner metrics aggregated next to the reward
# and, in learning_curves.json only, how far the learner's log-probs of the trained tokens are from serving's (on-policy
# ratio_mean is 1 and logprob_gap ~0: what a clip fraction above 0 comes from)
RATIO_METRICS = ("ratio_mean", "logprob_gap")


@dataclass
class SeedRun:
    """One seed's run as read back: per-step training reward, evaluation means, per-execution eval rewards."""

    seed: int
    workdir: Path
    train_reward: dict[int, float] = field(default_factory=dict)  # step -> reward_mean
    train_pass: dict[int, float] = field(default_factory=dict)  # step -> pass_rate (share of executions with reward 1)
    train_metrics: dict[str, dict[int, float]] = field(default_factory=dict)  # key of TRAIN_METRICS -> step -> value
    evals: dict[tuple[str, int], float] = field(default_factory=dict)  # (split, after_steps) -> eval_reward_mean
    eval_rewards: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)  # (split, after_steps) -> [n]
    # where the run's time went, from its metrics: "eval/<after_steps>" (each evaluation's seconds), "rl_steps" (the
    # RL steps' seconds, summed) and "rl_step/<step>"; a seed's whole wall time is in the result's ``wall_s``
    durations: dict[str, float] = field(default_factory=dict)
    source: str = ""  # how a seed read from an earlier result was obtained, if not from its run directory as such

    def to_record(self) -> dict:
        """What ``learning_curves.json`` keeps of this seed (``runs.<seed>``), so that a seed whose run directory is
        gone (another session, another machine) still counts in a later analysis: ``from_record`` reads it back."""
        return {
            "workdir": str(self.workdir),
            "train_reward": {str(k): v for k, v in sorted(self.train_reward.items())},
            "train_pass": {str(k): v for k, v in sorted(self.train_pass.items())},
            "train_metrics": {m: {str(k): v for k, v in sorted(d.items())} for m, d in self.train_metrics.items()},
            "evals": {f"{split}/{step}": v for (split, step), v in sorted(self.evals.items())},
            "eval_rewards": {f"{split}/{step}": r.tolist() for (split, step), r in sorted(self.eval_rewards.items())},
            **({"durations": self.durations} if self.durations else {}),
            **({"source": self.source} if self.source else {}),
        }

    @classmethod
    def from_record(cls, seed: int, record: dict) -> SeedRun:
        def steps(d: dict) -> dict[int, float]:
            return {int(k): float(v) for k, v in d.items()}

        def split_step(key: str) -> tuple[str, int]:
            split, step = key.rsplit("/", 1)
            return split, int(step)

        return cls(
            seed=seed,
            workdir=Path(record.get("workdir", "")),
            train_reward=steps(record["train_reward"]),
            train_pass=steps(record.get("train_pass", {})),
            train_metrics={m: steps(d) for m, d in record.get("train_metrics", {}).items()},
            evals={split_step(k): float(v) for k, v in record.get("evals", {}).items()},
            eval_rewards={split_step(k): np.asarray(v, np.float64) for k, v in record.get("eval_rewards", {}).items()},
            durations={k: float(v) for k, v in record.get("durations", {}).items()},
            source=record.get("source", ""),
        )


def read_run(workdir: Path, seed: int) -> SeedRun:
    """The metrics of the run in ``workdir`` (its ``metrics.jsonl``, and ``results/eval_*.jsonl`` if present)."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the seed-{seed} run has not written metrics (run it first)")
    run = SeedRun(seed=seed, workdir=workdir)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        m = json.loads(line)
        if m.get("phase") == "train" and "reward_mean" in m:
            run.train_reward[int(m["step"])] = float(m["reward_mean"])  # a resumed step's last line wins
            if m.get("pass_rate") is not None:
                run.train_pass[int(m["step"])] = float(m["pass_rate"])
            for key in TRAIN_METRICS + RATIO_METRICS:
                if m.get(key) is not None:
                    run.train_metrics.setdefault(key, {})[int(m["step"])] = float(m[key])
            if m.get("step_s") is not None:
                run.durations[f"rl_step/{int(m['step'])}"] = float(m["step_s"])
        elif m.get("phase") == "eval" and "eval_reward_mean" in m:
            run.evals[(m.get("eval_split", "train"), int(m["step"]))] = float(m["eval_reward_mean"])
            if m.get("eval_s") is not None:  # one evaluation of both splits: each split's line holds its seconds
                run.durations[f"eval/{int(m['step'])}"] = float(m["eval_s"])
    steps = [v for k, v in run.durations.items() if k.startswith("rl_step/")]
    if steps:
        run.durations["rl_steps"] = float(sum(steps))
    config_split = _config_split(workdir)
    for f in sorted((workdir / "results").glob("eval_*.jsonl")):
        step = int(f.stem.split("_")[1])
        by_split: dict[str, list[float]] = {}
        for line in f.read_text().splitlines():
            r = json.loads(line)
            split = r.get("eval_split", config_split)  # older runs: one split, the config's
            if r.get("excluded") or r.get("reward") is None or split not in SPLITS:
                continue
            by_split.setdefault(split, []).append(float(r["reward"]))
        for split, rewards in by_split.items():
            run.eval_rewards[(split, step)] = np.asarray(rewards, np.float64)
    return run


def _config_split(workdir: Path) -> str | None:
    """The run's ``eval.split`` from its ``config.json`` (None if unknown)."""
    try:
        return json.loads((workdir / "config.json").read_text())["eval"]["split"]
    except (OSError, KeyError, ValueError):
        return None


def bootstrap_mean_interval(values: np.ndarray, rng: np.random.Generator, n_boot: int) -> tuple[float, float, float]:
    """(mean, low, high): ``values`` [n] and the percentile bootstrap interval of their mean."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return float("nan"), float("nan"), float("nan")
    idx = rng.integers(0, values.size, size=(n_boot, values.size))
    means = values[idx].mean(axis=1)
    a = (1 - CONFIDENCE) / 2
    return float(values.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def curves(runs: list[SeedRun], n_boot: int = 10_000, seed: int = 0, key: str = "reward_mean") -> dict:
    """A per-step training metric over the seeds (``key``: the reward, or one of TRAIN_METRICS):
    {"steps": [s], "mean", "low", "high": [s], "seeds": [s] counts}."""
    rng = np.random.default_rng(seed)
    series = [
        r.train_reward if key == "reward_mean" else r.train_pass if key == "pass_rate" else r.train_metrics.get(key, {})
        for r in runs
    ]
    steps = sorted({s for per_step in series for s in per_step})
    out: dict = {"steps": steps, "mean": [], "low": [], "high": [], "seeds": []}
    for s in steps:
        values = np.asarray([per_step[s] for per_step in series if s in per_step])
        mean, low, high = bootstrap_mean_interval(values, rng, n_boot)
        for key, v in (("mean", mean), ("low", low), ("high", high), ("seeds", int(values.size))):
            out[key].append(v)
    return out


def eval_curves(runs: list[SeedRun], n_boot: int = 10_000, seed: int = 0) -> dict:
    """Per split, the evaluation after each evaluated step (0 = before RL; ``eval.every_steps`` sets how often) over
    the seeds: {split: {"steps", "mean", "low", "high", "seeds"}}. With 0/1 rewards the mean is the pass rate."""
    rng = np.random.default_rng(seed)
    out: dict = {}
    for split in SPLITS:
        steps = sorted({s for r in runs for (sp, s) in r.evals if sp == split})
        if not steps:
            continue
        row: dict = {"steps": steps, "mean": [], "low": [], "high": [], "seeds": []}
        for s in steps:
            values = np.asarray([r.evals[(split, s)] for r in runs if (split, s) in r.evals])
            mean, low, high = bootstrap_mean_interval(values, rng, n_boot)
            for key, v in (("mean", mean), ("low", low), ("high", high), ("seeds", int(values.size))):
                row[key].append(v)
        out[split] = row
    return out


def table(evals: dict, gains: dict) -> str:
    """A markdown table: per evaluated step, each split's mean evaluation reward over seeds [95% interval], then
    the gains (after - before) with their intervals."""
    splits = list(evals)
    steps = sorted({s for e in evals.values() for s in e["steps"]})
    lines = ["| after RL steps | " + " | ".join(f"{sp} tasks" for sp in splits) + " |",
             "|---|" + "---|" * len(splits)]  # fmt: skip
    for s in steps:
        cells = []
        for sp in splits:
            e = evals[sp]
            i = e["steps"].index(s) if s in e["steps"] else None
            cells.append("" if i is None else f"{e['mean'][i]:.3f} [{e['low'][i]:.3f}, {e['high'][i]:.3f}]")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    for sp, g in gains.items():
        gain = g["gain"]
        lines.append(f"| gain, {sp} | {gain['mean']:+.3f} [{gain['low']:+.3f}, {gain['high']:+.3f}] "
                     f"({len(g['seeds'])} seeds) |" + " |" * (len(splits) - 1))  # fmt: skip
    return "\n".join(lines) + "\n"


def _two_level_gains(before: list[np.ndarray], after: list[np.ndarray], rng, n_boot: int) -> np.ndarray:
    """[n_boot] bootstrap replicates of the mean over seeds of (mean after - mean before), resampling seeds and
    then, within each resampled seed, its evaluation executions (before and after independently)."""
    k = len(before)

    def resampled_means(values: np.ndarray) -> np.ndarray:  # [n_boot, k]: one fresh resample per (b, slot)
        idx = rng.integers(0, values.size, size=(n_boot, k, values.size))
        return values[idx].mean(axis=-1)

    gain = np.stack([resampled_means(after[i]) - resampled_means(before[i]) for i in range(k)])  # [k, n_boot, k]
    picks = rng.integers(0, k, size=(n_boot, k))
    return gain[picks, np.arange(n_boot)[:, None], np.arange(k)[None, :]].mean(axis=1)


def eval_pairs(runs: list[SeedRun], split: str) -> list[tuple[SeedRun, int, int]]:
    """The seeds with an evaluation of ``split`` before RL and after it: (run, 0, its last evaluated step)."""
    pairs = []
    for r in runs:
        steps = sorted(s for (sp, s) in r.evals if sp == split)
        if len(steps) >= 2 and steps[0] == 0:
            pairs.append((r, steps[0], steps[-1]))
    return pairs


def gain_replicates(pairs: list[tuple[SeedRun, int, int]], split: str, rng, n_boot: int) -> tuple[np.ndarray, str]:
    """[n_boot] bootstrap replicates of the mean gain over ``pairs`` (``eval_pairs``) and the method: the two-level
    bootstrap ("seeds+executions") when every seed kept its per-execution rewards, else over seeds ("seeds")."""
    if all((split, s0) in r.eval_rewards and (split, s1) in r.eval_rewards for r, s0, s1 in pairs):
        before = [r.eval_rewards[(split, s0)] for r, s0, _ in pairs]
        after = [r.eval_rewards[(split, s1)] for r, _, s1 in pairs]
        return _two_level_gains(before, after, rng, n_boot), "seeds+executions"
    gains = np.asarray([r.evals[(split, s1)] - r.evals[(split, s0)] for r, s0, s1 in pairs])
    idx = rng.integers(0, gains.size, size=(n_boot, gains.size))
    return gains[idx].mean(axis=1), "seeds"


def eval_gains(runs: list[SeedRun], n_boot: int = 10_000, seed: int = 0) -> dict:
    """Per split: before / after means over seeds with intervals, the per-seed gains, and the gain's interval.

    ``method`` says which bootstrap gave the gain's interval ("seeds+executions" or "seeds")."""
    rng = np.random.default_rng(seed)
    a = (1 - CONFIDENCE) / 2
    out: dict = {}
    for split in SPLITS:
        pairs = eval_pairs(runs, split)
        if not pairs:
            continue
        before = np.asarray([r.evals[(split, s0)] for r, s0, _ in pairs])
        after = np.asarray([r.evals[(split, s1)] for r, _, s1 in pairs])
        row = {
            "seeds": [r.seed for r, _, _ in pairs],
            "after_steps": [s1 for _, _, s1 in pairs],
            "before": dict(zip(("mean", "low", "high"), bootstrap_mean_interval(before, rng, n_boot))),
            "after": dict(zip(("mean", "low", "high"), bootstrap_mean_interval(after, rng, n_boot))),
            "gain_per_seed": (after - before).tolist(),
        }
        reps, row["method"] = gain_replicates(pairs, split, rng, n_boot)
        low, high = float(np.quantile(reps, a)), float(np.quantile(reps, 1 - a))
        row["gain"] = {"mean": float((after - before).mean()), "low": low, "high": high}
        row["gain"]["excludes_zero"] = bool(row["gain"]["low"] > 0 or row["gain"]["high"] < 0)
        out[split] = row
    return out


def plot(curve: dict, gains: dict, path: Path, title: str, evals: dict | None = None) -> None:
    """Two panels: training reward per step (mean +- 95% interval) and evaluation before / after per split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    steps = np.asarray(curve["steps"]) + 1
    if len(steps):
        ax1.plot(steps, curve["mean"], color="C0", label="mean over seeds")
        ax1.fill_between(steps, curve["low"], curve["high"], color="C0", alpha=0.25, label="95% bootstrap interval")
    for j, (split, e) in enumerate((evals or {}).items()):  # evaluations after each evaluated step
        ax1.errorbar(np.asarray(e["steps"]), e["mean"], yerr=[np.subtract(e["mean"], e["low"]),
                     np.subtract(e["high"], e["mean"])], fmt="o--", color=f"C{j + 3}", capsize=3,
                     label=f"evaluation, {split} tasks")  # fmt: skip
    ax1.set_xlabel("RL step")
    ax1.set_ylabel("training reward (mean of the step's executions)")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend(loc="lower right")
    ax1.set_title("training reward")
    width = 0.35
    for j, (label, key) in enumerate((("before RL", "before"), ("after RL", "after"))):
        names = list(gains)
        means = [gains[s][key]["mean"] for s in names]
        err = np.asarray([[m - gains[s][key]["low"], gains[s][key]["high"] - m] for s, m in zip(names, means)]).T
        x = np.arange(len(names)) + (j - 0.5) * width
        ax2.bar(x, means, width, yerr=err if len(names) else None, capsize=4, label=label, color=f"C{j + 1}")
    ax2.set_xticks(np.arange(len(gains)))
    ax2.set_xticklabels([f"{s}\ngain {g['gain']['mean']:+.3f}" for s, g in gains.items()])
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("evaluation reward")
    ax2.legend(loc="upper left")
    ax2.set_title("evaluation (95% intervals)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gain_lines(gains: dict) -> list[str]:
    """One printed line per split: before, after and the gain with its 95% interval."""
    lines = []
    for split, g in gains.items():
        gain = g["gain"]
        lines.append(
            f"{split:>8} tasks: before {g['before']['mean']:.3f}  after {g['after']['mean']:.3f}  gain "
            f"{gain['mean']:+.3f}  95% [{gain['low']:+.3f}, {gain['high']:+.3f}] ({len(g['seeds'])} seeds, "
            f"bootstrap over {g['method']}){'' if gain['excludes_zero'] else '  (includes 0)'}"
        )
    return lines


def time_lines(runs: list[SeedRun], wall: dict[int, float]) -> list[str]:
    """One printed line per seed: its wall time and where it went (each evaluation, the RL steps)."""
    lines = []
    for r in runs:
        evals = sorted((int(k.split("/")[1]), v) for k, v in r.durations.items() if k.startswith("eval/"))
        parts = [f"evaluation after {step} steps {v / 60:.1f} min" for step, v in evals]
        n = sum(k.startswith("rl_step/") for k in r.durations)
        if n:
            parts.insert(min(1, len(parts)), f"{n} RL steps {r.durations['rl_steps'] / 60:.1f} min")
        total = f"{wall[r.seed] / 60:.1f} min" if r.seed in wall else "wall time not recorded"
        lines.append(f"seed {r.seed}: {total}" + (f" ({', '.join(parts)})" if parts else ""))
    return lines


class LoadSampler:
    """The machine's 1-minute load average, sampled every ``period_s`` seconds while in a ``with`` block (a
    run's wall time means little without it: these machines are shared). ``summary()``: start, end, mean, max."""

    def __init__(self, period_s: float = 5.0):
        self.period_s = period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.period_s):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict:
        x = self.samples
        return {"start": x[0], "end": x[-1], "mean": float(np.mean(x)), "max": max(x), "samples": len(x),
                "cpus": os.cpu_count()}  # fmt: skip


def run_seed(config: str, seed: int, workdir: Path, overrides: list[str]) -> tuple[float, dict]:
    """Runs (or resumes) one seed's training; returns its wall time in seconds and the load average over it
    (``LoadSampler.summary``)."""
    cmd = [sys.executable, "-m", "gyre_jax.train", "--config", config, f"--config.seed={seed}"]
    cmd += [f"--config.workdir={workdir}", "--config.metrics.progress_bar=False", *overrides]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    with LoadSampler() as load:
        subprocess.run(cmd, check=True, cwd=REPO)
    return time.time() - t0, load.summary()


def complete(workdir: Path, total_steps: int | None) -> bool:
    """Whether the run in ``workdir`` trained its last step and evaluated after it."""
    try:
        run = read_run(workdir, -1)
    except FileNotFoundError:
        return False
    last = max(run.train_reward, default=-1) + 1
    return last > 0 and (total_steps is None or last >= total_steps) and any(s == last for _, s in run.evals)


def gather_runs(runs_dir: Path, seeds: list[int], earlier: dict) -> list[SeedRun]:
    """Every seed this result is made of, by seed: a run directory ``runs_dir/seed<k>`` with a ``metrics.jsonl``
    (this invocation's seeds and any other found there), else the seed's record in the ``learning_curves.json`` an
    earlier invocation wrote (``runs.<k>``: seeds run in another session, whose directories may be gone). Says
    where each came from, so no seed drops out of a result unnoticed."""
    found = {int(d.name[4:]) for d in runs_dir.glob("seed*") if d.name[4:].isdigit() and (d / "metrics.jsonl").exists()}
    recorded = {int(k) for k in earlier.get("runs", {})}
    runs = []
    for s in sorted(found | recorded | set(seeds)):
        if s in found:
            runs.append(read_run(runs_dir / f"seed{s}", s))
            print(f"seed {s}: read from {runs_dir / f'seed{s}'}", flush=True)
        elif s in recorded:
            runs.append(SeedRun.from_record(s, earlier["runs"][str(s)]))
            print(f"seed {s}: its run directory is not here; read from the earlier learning_curves.json", flush=True)
    return runs


def _earlier_result(path: Path) -> dict:
    """The learning_curves.json already at ``path`` ({} if none or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_cpu.py")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (--config.total_steps)")
    parser.add_argument("--out", type=Path, default=None, help="default: experiments/results/learning_curves/<config>")
    parser.add_argument(
        "--runs-dir", type=Path, default=None, help="the seeds' workdirs (default: runs/learning_curves/<config>)"
    )
    parser.add_argument("--analyze-only", action="store_true", help="read the runs' metrics, run nothing")
    parser.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        parser.error(f"unknown arguments {bad}: overrides are --config.<key>=<value>")
    if args.steps is not None:
        overrides.append(f"--config.total_steps={args.steps}")
    out = args.out or REPO / "experiments" / "results" / "learning_curves" / Path(args.config).stem
    runs_dir = args.runs_dir or REPO / "runs" / "learning_curves" / Path(args.config).stem  # git-ignored
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    wall: dict[int, float] = {}
    load: dict[int, dict] = {}
    if not args.analyze_only:
        for s in seeds:
            workdir = runs_dir / f"seed{s}"
            if complete(workdir, args.steps):
                print(f"seed {s}: complete in {workdir}, not run again", flush=True)
                continue
            wall[s], load[s] = run_seed(args.config, s, workdir, overrides)
            print(f"seed {s}: {wall[s]:.0f} s, load average {load[s]['mean']:.2f} (max {load[s]['max']:.2f}) "
                  f"on {load[s]['cpus']} CPUs", flush=True)  # fmt: skip
    earlier = _earlier_result(out / "learning_curves.json")
    runs = gather_runs(runs_dir, seeds, earlier)
    if not runs:
        raise SystemExit(f"error: no run under {runs_dir} has a metrics.jsonl; run without --analyze-only first")
    curve, gains = curves(runs, args.bootstrap), eval_gains(runs, args.bootstrap)
    evals = eval_curves(runs, args.bootstrap)
    out.mkdir(parents=True, exist_ok=True)
    # A seed not run by this invocation (complete before, or --analyze-only) keeps the wall time and load its own run
    # recorded in an earlier learning_curves.json here (seeds run in different sessions add up to one result).
    for s in (r.seed for r in runs):
        if s not in wall and str(s) in earlier.get("wall_s", {}):
            wall[s], load[s] = earlier["wall_s"][str(s)], earlier.get("load_avg_1min", {}).get(str(s))
    result = {
        "config": args.config,
        "overrides": overrides or earlier.get("overrides", []),
        "seeds": [r.seed for r in runs],
        "wall_s": {str(k): v for k, v in wall.items()},
        "load_avg_1min": {str(k): v for k, v in load.items()},  # over each seed's run (LoadSampler)
        "confidence": CONFIDENCE,
        "bootstrap": args.bootstrap,
        "train_reward": curve,
        "train_pass_rate": curves(runs, args.bootstrap, key="pass_rate"),
        "train_metrics": {key: curves(runs, args.bootstrap, key=key) for key in TRAIN_METRICS + RATIO_METRICS},
        "eval": gains,
        "eval_curves": evals,
        "runs": {str(r.seed): r.to_record() for r in runs},  # each seed's data (gather_runs reads it back)
    }
    (out / "learning_curves.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(curve, gains, out / "learning_curves.png", f"{args.config}: {len(runs)} seeds", evals)
    (out / "learning_curves.md").write_text(table(evals, gains))
    print(table(evals, gains))
    for line in gain_lines(gains) + time_lines(runs, wall):
        print(line)
    print(f"wrote {out / 'learning_curves.json'}, {out / 'learning_curves.png'} and {out / 'learning_curves.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
