"""One of 2 processes (4 virtual CPU devices each) moving serving sessions, KV included, between processes.

    python tests/runtime/migrate_worker.py PID PORT OUT_DIR

Cell 0 is on process 0 (a ``LocalCell``), cell 1 on process 1 (a ``CellHost``'s loop, driven from process 0
through a ``RemoteCell``). Both engines are slowed down per decode step so that process 0 can
move requests while they generate. Process 0 writes ``OUT_DIR/migrate.json``: the completions of the same
requests run without a move, moved from process 1 to process 0 mid-generation, and moved from process 0
to process 1, plus a cached session that moved and a cancel that followed a moved request.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "serving"))
sys.path.insert(0, str(REPO / "tests"))
from timelimits import scaled  # noqa: E402  (tests/timelimits.py, on the path above)

STEP_S = 0.03  # per decode step: 40 tokens take > 1 s, so a move after 3 steps lands mid-generation
MAX_TOKENS = 40


def main() -> int:
    pid, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    from layouts import EIGHT_DEVICES

    from gyre_jax import runtime
    from gyre_jax.config import config_from_dict, load_config

    config = config_from_dict(
        load_config(EIGHT_DEVICES),  # 4 devices per process: each process holds one cell of 4
        {
            "distributed.enabled": True,
            "distributed.coordinator_address": f"127.0.0.1:{port}",
            "distributed.num_processes": 2,
            "distributed.process_id": pid,
            "distributed.heartbeat_timeout_s": 10.0,
        },
    )
    runtime.initialize(config)

    from slow_engine import SlowEngine

    from gyre_jax.model.config import ModelConfig
    from gyre_jax.model.sharding import abstract_model, init_params
    from gyre_jax.runtime.cells import CellLayout
    from gyre_jax.runtime.host import CellHost, HostedCell
    from gyre_jax.runtime.local import LocalCell
    from gyre_jax.runtime.remote import FollowerLink, RemoteCell, TransferLog
    from gyre_jax.serving.engine import Engine
    from gyre_jax.serving.loop import ServingLoop
    from gyre_jax.serving.types import GenerationRequest, SamplingParams

    rules = tuple((k, v) for k, v in config.sharding_rules)
    cfg = ModelConfig(
        vocab_size=272,
        num_layers=2,
        embed_dim=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        rope_theta=10000.0,
    )
    cells = runtime.make_cells(None, 2, {"data": 4})
    mesh = runtime.make_train_mesh({"data": 8})
    _, params = init_params(cfg, mesh, rules, seed=0)
    graphdef = abstract_model(cfg)[0]
    engines = {
        c.index: Engine(
            cfg,
            graphdef,
            c.mesh,
            rules,
            max_concurrent_decodes=4,
            max_seq_len=128,
            max_prefill_length=64,
            prefill_buckets=(16, 32, 64),
            page_size=16,
        )
        for c in cells
    }
    layouts = {c.index: CellLayout.of(c, cfg, rules, page_size=16) for c in cells}
    per_cell = runtime.publish_to_cells(params, [layouts[c.index].param_shardings for c in cells])
    mine = per_cell[pid]
    client = runtime.runtime().client

    if pid == 1:
        loop = ServingLoop(SlowEngine(engines[1], STEP_S), mine, name="cell1", kv_pages=64).start()
        hosted = HostedCell(LocalCell(cells[1], layouts[1], loop, worker=None))
        CellHost(client, 1, {1: hosted}, layouts, core_abstract=None).serve()
        runtime.shutdown()
        return 0

    loop = ServingLoop(SlowEngine(engines[0], STEP_S), mine, name="cell0", kv_pages=64).start()
    a = LocalCell(cells[0], layouts[0], loop, worker=None)
    link = FollowerLink(client, 1)
    b = RemoteCell(link, TransferLog(), cells[1], layouts[1], core_shardings=None, max_context=128)
    prompts = [[7, 8, 9, 10, 11], list(range(20, 33)), [42] * 22]
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=11),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
    ]

    def batch(tag):
        return [GenerationRequest(p, s, session_id=f"{tag}-{i}") for i, (p, s) in enumerate(zip(prompts, kinds))]

    def tokens(futures):
        return [
            (r.token_ids, r.cell, r.finish_reason, r.logprobs) for r in (f.result(timeout=scaled(120)) for f in futures)
        ]

    def decoding(cell, submit):
        """Submits, then returns once the cell's loop has run 3 decode steps with all 3 requests in the batch
        (each has generated tokens, none can have finished its 40): a move then lands mid-generation however
        loaded the machine is (a fixed sleep did not, under CI load: 2 of 3 had generated nothing yet)."""
        before = len(cell.stats().step_log)
        futures = submit()
        limit = scaled(120)
        deadline = time.time() + limit
        while sum(1 for jobs, *_ in cell.stats().step_log[before:] if jobs >= 3) < 3:
            if time.time() > deadline:
                raise SystemExit(f"{cell.name}: 3 requests were not decoding together within {limit:.0f} s")
            time.sleep(0.01)
        return futures

    result = {"unmoved": tokens([a.submit(r) for r in batch("ref")])}
    tokens([b.submit(r) for r in batch("warm")])  # process 1's loop has compiled what the batch needs
    # process 1 -> process 0, mid-generation
    futures = decoding(b, lambda: [b.submit(r) for r in batch("p1")])
    moved = b.move_sessions_to(a)
    result["moved_1_to_0"] = tokens(futures)
    result["moved_1_to_0_states"] = [[s.in_flight, s.generated] for s in moved]
    # process 0 -> process 1, mid-generation; one of them cancelled after the move (the cancel follows it)
    reqs = batch("p0")
    futures = decoding(a, lambda: [a.submit(r) for r in reqs])
    moved = a.move_sessions_to(b)
    result["moved_0_to_1_states"] = [[s.in_flight, s.generated] for s in moved]
    cancel = GenerationRequest(prompts[0], SamplingParams(temperature=0.0, max_tokens=120), session_id="c")
    fc = a.submit(cancel)
    time.sleep(0.3)
    a.move_sessions_to(b)
    a.cancel(cancel.request_id)  # a no longer holds it: the cancel must reach process 1
    result["moved_0_to_1"] = tokens(futures)
    result["cancelled"] = tokens([fc])[0][2:3]
    # an idle session's cached KV moves too: its next call on process 1 reuses it
    first = a.submit(GenerationRequest(prompts[1], kinds[0], session_id="warm")).result(timeout=scaled(120))
    a.move_sessions_to(b)
    follow = b.submit(
        GenerationRequest(
            prompts[1] + first.token_ids + [5, 6], SamplingParams(temperature=0.0, max_tokens=4), session_id="warm"
        )
    ).result(timeout=scaled(120))
    result["warm_cached_tokens"] = follow.cached_tokens
    result["warm_prompt_len"] = len(prompts[1]) + len(first.token_ids) + 2
    a.close()
    link.close()
    (out / "migrate.json").write_text(json.dumps(result))
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
