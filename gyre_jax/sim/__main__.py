"""Command line: simulate one run of a preset and print its summary.

    python -m gyre_jax.sim --config deepswe --config.schedule.policy=async --timeline /tmp/t.json --out /tmp/r.json

``--config`` is a preset name (deepswe, terminal, nl2repo, flagship, tiny) or a configs/sim_*.py file;
``--config.a.b=value`` overrides any field. ``--timeline`` writes the Chrome-trace timeline
(``experiments/plot_timeline.py`` draws it), ``--out`` the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from gyre_jax.config import ConfigError, parse_args
from gyre_jax.elastic.timeline import TimelineWriter
from gyre_jax.sim.config import load_sim_config
from gyre_jax.sim.simulator import Simulator


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m gyre_jax.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeline", default=None, help="write the timeline (Chrome trace JSON) here")
    ap.add_argument("--trace-executions", action="store_true", help="put every execution in the timeline")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    config_args, other = [], []
    i = 0
    while i < len(argv):
        if argv[i] in ("--config", "-c") and i + 1 < len(argv):
            config_args += argv[i : i + 2]
            i += 2
            continue
        (config_args if argv[i].startswith("--config") else other).append(argv[i])
        i += 1
    own = ap.parse_args(other)
    try:
        spec, overrides = parse_args(config_args or ["--config", "deepswe"])
        config = load_sim_config(spec, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    timeline = None
    if own.timeline:
        timeline = TimelineWriter(own.timeline, config.cell_names, source="sim", flush_every=4096)
    t0 = time.process_time()
    result = Simulator(config, timeline=timeline, trace_executions=own.trace_executions).run()
    if timeline is not None:
        timeline.close(result.makespan_s)
    cpu = time.process_time() - t0
    print(
        f"{config.name}: {config.policy} {dict(config.policy_options)} on {config.accelerators} accelerators "
        f"({config.num_cells} cells), {config.steps} steps of {config.batch_size} executions"
    )
    print(
        f"  makespan {result.makespan_s / 3600:.2f} h, {result.step_time_s / 60:.1f} min/step, "
        f"busy {result.busy_fraction:.1%} (serving {result.serving_busy_fraction:.1%}, "
        f"training {result.training_busy_fraction:.1%}), staleness max {result.staleness['max']}"
    )
    tok, part = result.token_staleness, result.partial
    print(
        f"  per-token staleness max {tok['max']} / mean {tok['mean']:.2f}"
        + (
            f"; partial rollouts: {part['carried_groups']} groups carried, {part['dropped']} executions dropped"
            if config.partial_rollouts
            else ""
        )
    )
    print(f"  simulated in {cpu:.2f} s CPU ({result.sim['events']} events)")
    if own.out:
        with open(own.out, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
