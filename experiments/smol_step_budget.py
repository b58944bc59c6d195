"""The parts of one RL step of configs/smollm2_cpu.py on this machine, measured on the real model (issue 42 item 3).

Two measurements, each through the run's own code on one cell (the config's model, dtype, attention kernel,
remat and serving keys; ``--config.a.b=v`` overrides any of them):

  serving   generated tokens/s of a cell's ``ServingLoop`` with N concurrent sessions (closed loop: each session
            sends its next request, its previous prompt + completion + an observation, when the last returns):
            prompts, observations and completion lengths like mini-swe-agent's on suites/smol
  training  seconds per learner micro-step (forward + backward + the AdamW update of ``Learner.step``) on a
            micro-batch of ``trajectory.tokens_per_micro_batch`` tokens, and the tokens/s it implies

    python experiments/smol_step_budget.py --slots 8 16 --out /tmp/budget.json
    python experiments/smol_step_budget.py --what training --config.model.checkpoint_layers=2

Prints a table and writes JSON (absolute times on a shared machine: the load average is recorded with them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _config(overrides: list[str]):
    from gyre_jax import config as config_lib

    return config_lib.load_config(["--config", str(REPO / "configs" / "smollm2_cpu.py"), *overrides])


def _closed_loop(loop, sessions: int, turns: int, prompt_len: int, obs_len: int, sampling, vocab: int) -> int:
    """``sessions`` concurrent sessions of ``turns`` requests each (each prompt extends the last); tokens generated."""
    import numpy as np

    from gyre_jax.serving.types import GenerationRequest

    generated, lock = [0], threading.Lock()

    def session(i: int) -> None:
        rng = np.random.default_rng(i)
        prompt = [int(t) for t in rng.integers(100, vocab, prompt_len)]
        for _ in range(turns):
            res = loop.submit(GenerationRequest(prompt, sampling, session_id=f"s{i}")).result()
            with lock:
                generated[0] += len(res.token_ids)
            prompt = prompt + list(res.token_ids) + [int(t) for t in rng.integers(100, vocab, obs_len)]

    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return generated[0]


def _serving(s, slots_list: list[int], turns: int, prompt_len: int, obs_len: int, max_tokens: int, temperature: float):
    import dataclasses

    from gyre_jax import build
    from gyre_jax.runtime.transfer import transfer
    from gyre_jax.serving.types import SamplingParams

    factory = build.CellFactory(s)
    cell = s.cells[0]
    params = transfer(s.params, factory.layout(cell).param_shardings, may_alias=False)
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    rows = []
    for slots in slots_list:
        sv = dataclasses.replace(s.config.serving, max_concurrent_decodes=slots)
        s.config = dataclasses.replace(s.config, serving=sv)
        loop = factory.loop(cell, params, 0)
        _closed_loop(loop, 1, 1, prompt_len, obs_len, sampling, s.model_cfg.vocab_size)  # compiles the first shapes
        t0 = time.perf_counter()
        generated = _closed_loop(loop, slots, turns, prompt_len, obs_len, sampling, s.model_cfg.vocab_size)
        dt = time.perf_counter() - t0
        loop.stop()
        row = {"slots": slots, "sessions": slots, "turns": turns, "generated": generated, "seconds": dt,
               "tokens_per_s": generated / dt, "load": os.getloadavg()}  # fmt: skip
        print(f"serving  slots {slots:3d}  {generated:6d} tokens in {dt:7.1f} s  {row['tokens_per_s']:6.1f} tok/s  "
              f"load {row['load'][0]:.1f}", flush=True)  # fmt: skip
        rows.append(row)
    return rows


def _training(s, repeats: int):
    import numpy as np

    from gyre_jax.rl.learner import Learner
    from gyre_jax.trajectory.batch import supervised_micro_batch

    c = s.config
    learner = Learner(s.model_cfg, s.graphdef, s.cells[0].mesh, s.rules, c.optimizer, loss_cfg=c.loss_config())
    state = learner.init_state(s.params)
    length, tokens = c.trajectory.row_length, c.trajectory.tokens_per_micro_batch
    rng = np.random.default_rng(0)
    seqs = [(list(rng.integers(100, s.model_cfg.vocab_size, length + 1)), [True] * (length + 1))
            for _ in range(tokens // length)]  # fmt: skip
    mb = supervised_micro_batch(seqs, tokens, length)
    rows = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        state, m = learner.step(state, [mb], kind="sft")
        float(m["loss"])
        dt = time.perf_counter() - t0
        what = "compile+step" if i == 0 else "step"
        print(f"training {what:12s} [{tokens // length}, {length}]  {dt:7.1f} s  {tokens / dt:6.1f} tok/s  "
              f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        rows.append({"what": what, "rows": tokens // length, "row_length": length, "seconds": dt,
                     "tokens_per_s": tokens / dt, "load": os.getloadavg()})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", choices=("serving", "training", "both"), default="both")
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=110)
    ap.add_argument("--obs-len", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="/tmp/smol_step_budget.json")
    args, overrides = ap.parse_known_args()
    config = _config(overrides)
    from gyre_jax import build, runtime

    runtime.initialize(config)
    s = build.setup(config)
    out = {"config_overrides": overrides, "load_start": os.getloadavg(), "model_params": s.model_cfg.num_params}
    import resource

    if args.what in ("training", "both"):
        out["training"] = _training(s, args.repeats)
    if args.what in ("serving", "both"):
        out["serving"] = _serving(s, args.slots, args.turns, args.prompt_len, args.obs_len, args.max_tokens,
                                  config.rollout.temperature)  # fmt: skip
    out["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"max RSS {out['max_rss_gib']:.1f} GiB")
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
