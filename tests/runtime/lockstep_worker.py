"""One of 4 processes (2 virtual CPU devices each) serving two cells of 2 processes each, moving sessions, KV
included, between the two multi-host cells.

    python tests/runtime/lockstep_worker.py PID PORT OUT_DIR

Cell 0 is processes 0 and 1, cell 1 processes 2 and 3. Each cell's first process drives it (process 0: a
``LocalCell``; process 2: a ``CellHost``'s loop, driven from process 0 through a ``RemoteCell``) and runs its
engine's programs in lockstep with the cell's other process (``runtime.lockstep``), which replays them. The engines
are slowed down per decode step so that process 0 can move requests while they generate. Process 0 writes
``OUT_DIR/lockstep.json``: the completions of the same requests without a move, moved from cell 1 to cell 0
mid-generation and from cell 0 to cell 1, a cached session that moved, a cancel that followed a moved request, how
many lockstep calls each driver sent and how long each move took (``move_s``).
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

STEP_S = 0.03  # per decode step: 40 tokens take > 1 s, so a move after 3 steps lands mid-generation
MAX_TOKENS = 40


class Factory:
    """What both processes of a cell build the cell's engine with (``make_engine``, bound by the driver's call)."""

    def __init__(self, cfg, graphdef, rules):
        self.cfg, self.graphdef, self.rules = cfg, graphdef, rules

    def make_engine(self, cell):
        from gyre_jax.serving.engine import Engine

        return Engine(self.cfg, self.graphdef, cell.mesh, self.rules, max_concurrent_decodes=4, max_seq_len=128,
                      max_prefill_length=64, prefill_buckets=(16, 32, 64), page_size=16)  # fmt: skip


def main() -> int:
    pid, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    from layouts import EIGHT_DEVICES

    from gyre_jax import runtime
    from gyre_jax.config import config_from_dict, load_config

    config = config_from_dict(
        load_config(EIGHT_DEVICES),
        {
            "distributed.enabled": True,
            "distributed.coordinator_address": f"127.0.0.1:{port}",
            "distributed.num_processes": 4,
            "distributed.process_id": pid,
            "distributed.heartbeat_timeout_s": 10.0,
        },
    )
    runtime.initialize(config)

    from slow_engine import SlowEngine

    from gyre_jax.model.config import ModelConfig
    from gyre_jax.model.sharding import abstract_model, init_params
    from gyre_jax.runtime import lockstep
    from gyre_jax.runtime.cells import CellLayout
    from gyre_jax.runtime.host import CellHost, HostedCell
    from gyre_jax.runtime.local import LocalCell
    from gyre_jax.runtime.remote import FollowerLink, RemoteCell, TransferLog
    from gyre_jax.serving.loop import ServingLoop
    from gyre_jax.serving.types import GenerationRequest, SamplingParams

    rules = tuple((k, v) for k, v in config.sharding_rules)
    cfg = ModelConfig(vocab_size=272, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      mlp_dim=128, rope_theta=10000.0)  # fmt: skip
    cells = runtime.make_cells(None, 2, {"data": 2, "fsdp": 2})  # 4 devices over 2 processes each
    assert [c.processes for c in cells] == [(0, 1), (2, 3)]
    mesh = runtime.make_train_mesh({"data": 8})
    _, params = init_params(cfg, mesh, rules, seed=0)
    factory = Factory(cfg, abstract_model(cfg)[0], rules)
    layouts = {c.index: CellLayout.of(c, cfg, rules, page_size=16) for c in cells}
    per_cell = runtime.publish_to_cells(params, [layouts[c.index].param_shardings for c in cells])
    client = runtime.runtime().client
    cell = cells[pid // 2]
    objects = {"factory": factory, **{c.name: c for c in cells}}
    if pid % 2:  # the cell's second process: replays its driver's calls
        replayer = lockstep.Replayer(client, cell, pid, objects)
        replayer.adopt("params", per_cell[cell.index])
        replayer.run()
        runtime.shutdown()
        return 0
    group = lockstep.drive(client, cell, objects)
    mine = group.adopt("params", per_cell[cell.index])
    name = f"engine/{cell.name}"
    engine = lockstep.LockstepEngine(group, group.call("factory", "make_engine", cell, bind=name), name)
    loop = ServingLoop(SlowEngine(engine, STEP_S), mine, name=cell.name, kv_pages=64).start()
    if pid == 2:
        hosted = HostedCell(LocalCell(cell, layouts[1], loop, worker=None))
        CellHost(client, 2, {1: hosted}, layouts, core_abstract=None).serve()
        print(f"process 2 sent {group.calls} lockstep calls", flush=True)
        runtime.shutdown()
        return 0

    a = LocalCell(cells[0], layouts[0], loop, worker=None)
    link = FollowerLink(client, 2)
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
        return [(r.token_ids, r.cell, r.finish_reason, r.logprobs) for r in (f.result(timeout=300) for f in futures)]

    def decoding(cell, submit):
        """Submits, then returns once the cell's loop has run 3 decode steps with all 3 requests in the batch."""
        before = len(cell.stats().step_log)
        futures = submit()
        deadline = time.time() + 300
        while sum(1 for jobs, *_ in cell.stats().step_log[before:] if jobs >= 3) < 3:
            if time.time() > deadline:
                raise SystemExit(f"{cell.name}: 3 requests were not decoding together within 300 s")
            time.sleep(0.01)
        return futures

    result = {"unmoved": tokens([a.submit(r) for r in batch("ref")])}
    result["unmoved_on_cell1"] = tokens([b.submit(r) for r in batch("warm")])
    futures = decoding(b, lambda: [b.submit(r) for r in batch("c1")])  # cell 1 -> cell 0, mid-generation
    t0 = time.perf_counter()
    moved = b.move_sessions_to(a)
    move_s = {"1_to_0_in_flight": time.perf_counter() - t0}
    result["moved_1_to_0"] = tokens(futures)
    result["moved_1_to_0_states"] = [[s.in_flight, s.generated] for s in moved]
    reqs = batch("c0")  # cell 0 -> cell 1, mid-generation; one more cancelled after the move (the cancel follows it)
    futures = decoding(a, lambda: [a.submit(r) for r in reqs])
    t0 = time.perf_counter()
    moved = a.move_sessions_to(b)
    move_s["0_to_1_in_flight"] = time.perf_counter() - t0
    result["moved_0_to_1_states"] = [[s.in_flight, s.generated] for s in moved]
    cancel = GenerationRequest(prompts[0], SamplingParams(temperature=0.0, max_tokens=120), session_id="c")
    fc = a.submit(cancel)
    time.sleep(0.3)
    a.move_sessions_to(b)
    a.cancel(cancel.request_id)  # a no longer holds it: the cancel must reach cell 1
    result["moved_0_to_1"] = tokens(futures)
    result["cancelled"] = tokens([fc])[0][2:3]
    first = a.submit(GenerationRequest(prompts[1], kinds[0], session_id="warm")).result(timeout=300)
    t0 = time.perf_counter()
    a.move_sessions_to(b)  # an idle session's cached KV moves too: its next call on cell 1 reuses it
    move_s["0_to_1_idle"] = time.perf_counter() - t0
    follow = b.submit(
        GenerationRequest(
            prompts[1] + first.token_ids + [5, 6], SamplingParams(temperature=0.0, max_tokens=4), session_id="warm"
        )
    ).result(timeout=300)
    result["warm_cached_tokens"] = follow.cached_tokens
    result["warm_prompt_len"] = len(prompts[1]) + len(first.token_ids) + 2
    a.close()
    link.close()
    result["lockstep_calls_cell0"] = group.calls
    result["move_s"] = move_s  # timed on process 0: benchmarks/bench_lockstep.py reports them
    (out / "lockstep.json").write_text(json.dumps(result))
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
