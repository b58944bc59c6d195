"""Warm-up: after ``Engine.warmup`` / ``PagedEngine.warmup`` a serving loop's mix of requests (one prompt, a burst
of whole prompts in one program, a chunked long prompt, a session's next turn on its cached KV, multi-step
decode, greedy and sampled) compiles nothing (the backend's compile events, counted, and the programs' compiled
entries), and gives the tokens of an engine that was never warmed."""

from __future__ import annotations

import contextlib
import logging
import time

import jax
import numpy as np
import pytest
from timelimits import scaled

from gyre_jax import build
from gyre_jax.config import load_config
from gyre_jax.serving.engine import Engine
from gyre_jax.serving.loop import ServingLoop
from gyre_jax.serving.paged import PagedEngine
from gyre_jax.serving.types import GenerationRequest, SamplingParams

from .conftest import CFG, DECODE_SLOT_BUCKETS, MAX_PREFILL, MAX_SEQ_LEN, SLOTS

TIMEOUT = 120.0
KV_PAGES = 16  # the dense loops' session cache
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch: one per XLA compile


@contextlib.contextmanager
def compiles():
    """The names of the programs the backend compiles inside the block (any thread)."""
    names: list[str] = []

    def listen(event: str, duration: float, **kw) -> None:
        if event == BACKEND_COMPILE_EVENT:
            names.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _prompt(rng, n: int) -> list[int]:
    return rng.integers(0, 256, size=n).tolist()


def serve_mix(loop: ServingLoop) -> list[list[int]]:
    """A burst of 3 whole prompts at an idle loop (one session among them), one prompt alone, a chunked long prompt
    beside a sampled one, and the session's next turn (a cache hit); returns every completion's token ids."""
    rng = np.random.default_rng(7)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    sampled = SamplingParams(temperature=1.0, max_tokens=5, seed=11)
    out = []

    def run(requests):
        futures = [loop.submit(r) for r in requests]
        results = [f.result(timeout=scaled(TIMEOUT)) for f in futures]
        out.extend(r.token_ids for r in results)
        return results

    burst = [GenerationRequest(_prompt(rng, n), greedy) for n in (5, 20)]
    first = GenerationRequest(_prompt(rng, 9), greedy, session_id="s")
    run([*burst, first])  # the loop is idle: one prefill_many program (3 rows -> 4)
    run([GenerationRequest(_prompt(rng, 30), greedy)])
    run([GenerationRequest(_prompt(rng, MAX_PREFILL + 17), greedy), GenerationRequest(_prompt(rng, 12), sampled)])
    turn = first.prompt_ids + out[2] + _prompt(rng, 4)
    run([GenerationRequest(turn, greedy, session_id="s")])
    assert loop.stats.cache.hits >= 1  # the next turn decoded from its cached KV
    return out


def _loop(engine, params, **kw) -> ServingLoop:
    return ServingLoop(engine, params, name="warm", **kw)


@pytest.fixture(scope="module")
def cold_tokens(model_params, engine) -> list[list[int]]:
    """The mix served by the shared test engine, never warmed (its programs compile as the requests need them)."""
    loop = _loop(engine, model_params[1], kv_pages=KV_PAGES).start()
    try:
        return serve_mix(loop)
    finally:
        loop.stop()


def _serve_warm(engine, params, **kw) -> tuple[list[list[int]], object]:
    """The mix on a loop over the warmed ``engine``; asserts nothing compiles (compile events, compiled entries)."""
    loop = _loop(engine, params, **kw)
    before = engine.programs.count()
    with compiles() as names:
        loop.start()
        try:
            got = serve_mix(loop)
        finally:
            loop.stop()
    assert names == [] and engine.programs.count() == before
    assert loop.stats.generate_steps > loop.stats.generate_calls  # multi-step programs ran
    return got, loop.stats


def test_a_warmed_engine_serves_the_mix_without_compiling_and_with_the_same_tokens(
    model_params, cell_mesh, rules, cold_tokens
) -> None:
    graphdef, params, _ = model_params
    warm = Engine(CFG, graphdef, cell_mesh, rules, max_concurrent_decodes=SLOTS, max_seq_len=MAX_SEQ_LEN,
                  max_prefill_length=MAX_PREFILL, prefill_buckets=(16, MAX_PREFILL), decode_windows=(),
                  decode_slot_buckets=DECODE_SLOT_BUCKETS, decode_steps=2, num_pages=KV_PAGES)  # fmt: skip
    t0 = time.perf_counter()
    count = warm.warmup(params)
    print(f"dense warm-up: {count} program shapes in {time.perf_counter() - t0:.1f}s")
    # 2 buckets: prefill fresh and on a prefix (4), prefill_many for 2 prompts packed in 1 or 2 rows and 4 prompts
    # in 2, 3 or 4 rows (10), generate over 1 window x 2 slot buckets x {1, 2} steps (4): the model programs,
    # jitted per engine. Alone this engine compiles 31 shapes (also
    # insert of [1, 16], [1, 64], [1, S], insert_many x 4, release, the empty state and prefix, the cache pool,
    # save_slot, load_prefix); programs jitted from the same function with the same shardings share their
    # compiled shapes between engines, so after the shared test engine fewer are new.
    assert 18 <= count <= 31
    assert warm.warmup(params) == 0  # warm already
    got, stats = _serve_warm(warm, params, kv_pages=KV_PAGES)
    assert stats.prefill_calls <= stats.requests_done  # the burst went in one program
    assert got == cold_tokens


def test_a_warmed_paged_engine_serves_the_mix_without_compiling_leaks_nothing_and_gives_the_same_tokens(
    model_params, cell_mesh, rules, cold_tokens
) -> None:
    graphdef, params, _ = model_params
    warm = PagedEngine(CFG, graphdef, cell_mesh, rules, max_concurrent_decodes=SLOTS, num_pages=8, page_size=64,
                       max_prefill_length=MAX_PREFILL, prefill_buckets=(16, MAX_PREFILL), max_pages_per_slot=2,
                       decode_slot_buckets=(), decode_steps=2)  # fmt: skip
    pool_before = jax.device_get(warm.state.pool)
    t0 = time.perf_counter()
    count = warm.warmup(params)
    print(f"paged warm-up: {count} program shapes in {time.perf_counter() - t0:.1f}s")
    # prefill: each bucket over windows of 1 and 2 pages (4); prefill_many per bucket for 2 prompts in 1 or 2 rows
    # and 4 prompts in 2, 3 or 4 rows (10); generate over 1 and 2 pages x {1, 2} steps (4, one slot bucket);
    # set_slot, set_row, set_pending (3, shared with other paged engines of the same shardings)
    assert 18 <= count <= 21
    assert warm.warmup(params) == 0
    # the scratch work left the engine as it was: no page taken, no slot active or holding tokens, pool unchanged
    assert warm.allocator.num_used == 0 and not any(warm._active) and not any(warm._lengths)
    state = jax.device_get(warm.state)
    assert (state.table == warm.num_pages).all() and not state.active.any() and not state.lengths.any()
    jax.tree.map(np.testing.assert_array_equal, state.pool, pool_before)
    got, stats = _serve_warm(warm, params)
    assert stats.prefill_calls <= stats.requests_done  # the burst went in one program
    assert got == cold_tokens  # the dense engine's tokens (paged decoding equals dense: test_paged_loop.py)


def test_a_cell_factory_warms_each_cells_engine_once_when_it_builds_the_cells_loop(monkeypatch, caplog) -> None:
    """``serving.warmup``: ``CellFactory.loop`` warms the engine it builds (the dense one with the loop's session
    cache pool), logs the count and seconds; off, it does not. (The warm-up itself is stubbed: tested above.)"""
    small = ["--config.model.num_layers=1", "--config.model.embed_dim=32", "--config.model.mlp_dim=64",
             "--config.model.head_dim=8", "--config.model.num_heads=4", "--config.model.num_kv_heads=2"]  # fmt: skip
    calls = []
    monkeypatch.setattr(Engine, "warmup", lambda self, params: calls.append(("dense", self.num_pages)) or 7)
    monkeypatch.setattr(PagedEngine, "warmup", lambda self, params: calls.append(("paged", self.num_pages)) or 5)
    for layout, warm in (("dense", True), ("paged", True), ("dense", False)):
        config = load_config([*small, f"--config.serving.kv_layout={layout}", f"--config.serving.warmup={warm}"])
        s = build.setup(config)
        factory = build.CellFactory(s)
        cell = s.cells[0]
        params = jax.device_put(s.params, factory.layout(cell).param_shardings)
        calls.clear()
        with caplog.at_level(logging.INFO, logger="gyre_jax"):
            caplog.clear()
            factory.loop(cell, params, 0).stop()
        if not warm:
            assert calls == [] and "warm-up" not in caplog.text
            continue
        assert calls == [(layout, config.serving.kv_pages)]  # the engine's session pool: the loop's cache
        assert f"{cell.name}: serving warm-up compiled {7 if layout == 'dense' else 5} program shapes in" in caplog.text
