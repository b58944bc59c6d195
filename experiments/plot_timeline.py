"""Gantt chart of a run's timeline (simulated or real): each cell's role over time, micro-steps inside
training spans, optimizer steps, idle time, and the rollout waterlevel.

    python experiments/plot_timeline.py runs/exp1/timeline.json [--out gantt.png] [--start 0 --end 7200]

Reads the Chrome-trace timeline written by ``gyre_jax.elastic.timeline.TimelineWriter`` (the simulator
and the real controller write the same format). Training time without a micro-step or optimizer step
is drawn as idle (hatched), so the gap to a fully busy cluster shows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gyre_jax.elastic.timeline import Timeline, load_timeline  # noqa: E402

COLORS = {
    "serving": "#4C9BE8",
    "training": "#F2A541",
    "switching": "#B0B0B0",
    "micro_step": "#D9534F",
    "optimizer_step": "#5CB85C",
}


def _unit(span_s: float) -> tuple[float, str]:
    return (3600.0, "hours") if span_s > 3 * 3600 else (60.0, "minutes") if span_s > 180 else (1.0, "seconds")


def draw_gantt(tl: Timeline, ax, start: float = 0.0, end: float | None = None, title: str = "") -> None:
    """Cells on the y axis (cell 0, the core, on top); roles as bars; micro-steps as thin bars inside."""
    end = tl.t_end if end is None else end
    scale, unit = _unit(end - start)
    n = len(tl.cells)

    def clip(s):
        a, b = max(s.start, start), min(s.end, end)
        return (a - start) / scale, max(0.0, b - a) / scale

    for c in range(n):
        y = n - 1 - c
        for span in tl.roles[c]:
            if span.end <= start or span.start >= end:
                continue
            x, w = clip(span)
            hatch = "///" if span.name == "training" else None
            ax.broken_barh(
                [(x, w)],
                (y - 0.4, 0.8),
                facecolors=COLORS[span.name],
                alpha=0.35 if hatch else 0.9,
                hatch=hatch,
                edgecolor="none",
            )
        bars = [clip(s) for s in tl.micro_steps[c] if s.end > start and s.start < end]
        if bars:
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS["training"], edgecolor="none")
    opt = [clip(s) for s in tl.optimizer_steps if s.end > start and s.start < end]
    for (x, w), s in zip(opt, [s for s in tl.optimizer_steps if s.end > start and s.start < end]):
        y = n - 1 - s.args.get("cell", 0)
        ax.broken_barh(
            [(x, max(w, (end - start) / scale * 0.002))], (y - 0.45, 0.9), facecolors=COLORS["optimizer_step"]
        )
    ax.set_yticks(range(n))
    ax.set_yticklabels([tl.cells[n - 1 - i] for i in range(n)], fontsize=6 if n > 16 else 8)
    ax.set_xlim(0, (end - start) / scale)
    ax.set_xlabel(f"time ({unit})")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=COLORS["serving"]),
        plt.Rectangle((0, 0), 1, 1, color=COLORS["training"]),
        plt.Rectangle((0, 0), 1, 1, facecolor=COLORS["training"], alpha=0.35, hatch="///"),
        plt.Rectangle((0, 0), 1, 1, color=COLORS["switching"]),
        plt.Rectangle((0, 0), 1, 1, color=COLORS["optimizer_step"]),
    ]
    ax.legend(
        handles,
        ["serving", "training (micro-step)", "training, idle", "switching", "optimizer step"],
        loc="upper right",
        fontsize=7,
        ncol=5,
        framealpha=0.9,
    )
    if title:
        ax.set_title(title, fontsize=10)


def draw_waterlevel(tl: Timeline, ax, start: float = 0.0, end: float | None = None) -> None:
    end = tl.t_end if end is None else end
    scale, unit = _unit(end - start)
    pts = [(t, w) for t, w in tl.waterlevel if start <= t <= end]
    if not pts:
        return
    xs = [(t - start) / scale for t, _ in pts]
    for key, style in (("outstanding", "-"), ("dispatched", ":"), ("finished", "--")):
        ax.step(xs, [w[key] for _, w in pts], style, where="post", label=key, linewidth=1)
    ax.set_xlim(0, (end - start) / scale)
    ax.set_ylabel("executions")
    ax.set_xlabel(f"time ({unit})")
    ax.legend(fontsize=7, loc="upper left")


def plot(path: str | Path, out: str | Path, start: float = 0.0, end: float | None = None, title: str = "") -> Path:
    tl = load_timeline(path)
    fig, (ax1, ax2) = plt.subplots(
        2,
        1,
        figsize=(12, 2.5 + 0.22 * len(tl.cells) + 2),
        sharex=True,
        gridspec_kw={"height_ratios": [max(2.0, 0.22 * len(tl.cells)), 1.5]},
    )
    frac = tl.busy_fraction()
    draw_gantt(
        tl,
        ax1,
        start,
        end,
        title or f"{Path(path).name}: {tl.source} timeline (micro-steps {frac.get('micro_step', 0):.0%} of cell-time)",
    )
    draw_waterlevel(tl, ax2, start, end)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    plt.switch_backend("Agg")  # a file, no window (importers such as notebooks keep their own backend)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline", help="timeline.json written by a run or by the simulator")
    ap.add_argument("--out", default=None, help="PNG to write (default: beside the timeline, .png)")
    ap.add_argument("--start", type=float, default=0.0, help="seconds since the start of the run")
    ap.add_argument("--end", type=float, default=None, help="seconds since the start of the run")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    try:
        out = plot(args.timeline, args.out or Path(args.timeline).with_suffix(".png"), args.start, args.end, args.title)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
