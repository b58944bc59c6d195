"""Soak run (issue 44, item 4): the default config with the elastic policy for many RL steps, watching the trainer
for anything that grows without bound: its resident memory, open file descriptors, threads, child processes and
the run directory's size (and each of its subdirectories': records, executions, checkpoints grow by design,
one entry per execution or step), sampled at every step; then ``gyre_jax.audit`` over the run (0 executions lost or
doubled).

    python benchmarks/soak.py --steps 300 --workdir runs/soak          # the full run (hours; resumable)
    python benchmarks/soak.py --steps 10 --workdir /tmp/soak --smoke   # a short check of the benchmark itself

It runs ``python -m gyre_jax.train --config.schedule.policy=elastic --config.total_steps=STEPS
--config.workdir=WORKDIR [extra --config.* overrides after --]`` as a child and polls its /proc entries every
``--sample-s`` seconds; each time ``metrics.jsonl`` gains a train line, the latest sample is recorded for that
step in ``WORKDIR/soak/samples.jsonl``. **Resumable**: running the same command again resumes the training from
its last checkpoint (the trainer's own resume) and appends to the samples (a step already sampled is not sampled
again). At the end it prints, per series, the first, last, max, and the least-squares slope per step over all
steps and over the second half (the steady state: start-up, compilation and the first checkpoints are behind
it), and writes everything to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERIES = ("rss_mib", "fds", "threads", "children", "run_dir_mib")


def proc_sample(pid: int, workdir: Path) -> dict | None:
    """The trainer's RSS (MiB), open fds, threads, live descendant processes, and the run directory's size."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    threads = int(fields.get("Threads", "0").strip())
    parts = {p.name: round(dir_bytes(p) / 2**20, 2) for p in sorted(workdir.iterdir()) if p.is_dir()}
    return {"t": round(time.time(), 2), "rss_mib": round(rss_kib / 1024, 1), "fds": fds, "threads": threads,
            "children": len(descendants(pid)), "run_dir_mib": round(dir_bytes(workdir) / 2**20, 2),
            "run_dir_parts_mib": parts}  # fmt: skip


def descendants(root: int) -> list[int]:
    """Live (not zombie) processes below ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, stack = [], [root]
    while stack:
        for pid in children.get(stack.pop(), []):
            out.append(pid)
            stack.append(pid)
    return out


def dir_bytes(root: Path) -> int:
    """Bytes of disk blocks used under ``root`` (links not followed)."""
    total = 0
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(base, name)).st_blocks * 512
            except OSError:
                pass
    return total


def train_steps(metrics: Path) -> list[int]:
    """The steps of metrics.jsonl's train lines, in file order (a torn last line is skipped)."""
    steps = []
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return steps
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("phase") == "train":
            steps.append(int(entry["step"]))
    return steps


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than 2 points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def summarize(samples: list[dict]) -> dict:
    """Per series: first, last, max, slope per step over all steps and over the second half."""
    samples = sorted(samples, key=lambda s: s["step"])
    half = samples[len(samples) // 2 :]
    out = {}
    for key in SERIES:
        xs, ys = [s["step"] for s in samples], [s[key] for s in samples]
        out[key] = {"first": ys[0] if ys else None, "last": ys[-1] if ys else None, "max": max(ys, default=None),
                    "slope_per_step": round(slope(xs, ys), 5),
                    "slope_per_step_second_half": round(slope([s["step"] for s in half], [s[key] for s in half]), 5)}  # fmt: skip
    return out


def run_audit(workdir: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "gyre_jax.audit", str(workdir), "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)  # fmt: skip
    try:
        report = json.loads(done.stdout)
    except ValueError:
        report = {"error": (done.stdout + done.stderr)[-2000:]}
    report["exit_status"] = done.returncode
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workdir", default="runs/soak")
    parser.add_argument("--sample-s", type=float, default=2.0, help="how often the trainer's /proc is read")
    parser.add_argument("--out", default="", help="JSON report (default: WORKDIR/soak/report.json)")
    parser.add_argument("--smoke", action="store_true", help="a short check of this benchmark (say so in the report)")
    parser.add_argument("overrides", nargs="*", help="extra --config.* arguments for the trainer (after --)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir).resolve()
    soak = workdir / "soak"
    soak.mkdir(parents=True, exist_ok=True)
    samples_file = soak / "samples.jsonl"
    sampled = (
        {json.loads(line)["step"] for line in samples_file.read_text().splitlines()} if samples_file.exists() else set()
    )
    cmd = [sys.executable, "-m", "gyre_jax.train", "--config.schedule.policy=elastic",
           f"--config.total_steps={args.steps}", f"--config.workdir={workdir}", *args.overrides]  # fmt: skip
    print(f"soak: {' '.join(cmd)}  ({len(sampled)} steps sampled before)", flush=True)
    t0 = time.time()
    with open(soak / "train.log", "ab") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            latest = None
            while proc.poll() is None:
                latest = proc_sample(proc.pid, workdir) or latest
                new = [k for k in train_steps(workdir / "metrics.jsonl") if k not in sampled]
                if latest is not None and new:
                    with open(samples_file, "a", encoding="utf-8") as f:
                        for k in sorted(set(new)):
                            f.write(json.dumps({"step": k, **latest}) + "\n")
                            sampled.add(k)
                    print(f"  step {max(new) + 1}/{args.steps}: rss {latest['rss_mib']} MiB, fds {latest['fds']}, "
                          f"threads {latest['threads']}, children {latest['children']}, "
                          f"run dir {latest['run_dir_mib']} MiB", flush=True)  # fmt: skip
                time.sleep(args.sample_s)
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)  # the trainer saves a checkpoint; run the same command to resume
            proc.wait()
            print("soak: interrupted; run the same command again to resume", file=sys.stderr)
            return 130
    if proc.returncode != 0:
        print(f"soak: the trainer exited with status {proc.returncode} (see {soak / 'train.log'}); "
              "run the same command again to resume", file=sys.stderr)  # fmt: skip
        return 1
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    audit = run_audit(workdir)
    stats = summarize(samples)
    print(f"{'series':12s} {'first':>9s} {'last':>9s} {'max':>9s} {'slope/step':>11s} {'2nd half':>11s}")
    for key, s in stats.items():
        print(f"{key:12s} {s['first']:>9} {s['last']:>9} {s['max']:>9} {s['slope_per_step']:>11} "
              f"{s['slope_per_step_second_half']:>11}")  # fmt: skip
    print(f"audit: exit {audit.get('exit_status')}, lost {audit.get('lost')}, double counted "
          f"{audit.get('double_counted')}, executions trained {audit.get('executions_trained')}")  # fmt: skip
    report = {"command": cmd, "steps": args.steps, "smoke": args.smoke, "samples": len(samples),
              "this_attempt_s": round(time.time() - t0), "series": stats, "audit": audit,
              "per_step": sorted(samples, key=lambda s: s["step"])}  # fmt: skip
    out = Path(args.out) if args.out else soak / "report.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0 if audit.get("exit_status") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
