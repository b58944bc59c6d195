"""Tests for gyre_jax/rl/microstep_queue.py: slots, claims, release, close, abort, and concurrent workers."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from timelimits import scaled

from gyre_jax.rl.microstep_queue import MicroStepQueue, QueueAborted


def test_claims_go_lowest_index_first_and_the_step_ends_when_all_are_done():
    q = MicroStepQueue(3)
    assert q.put("b") == 0 and q.put("a", index=2) == 2 and q.put("c") == 1  # auto-fill skips the taken slot 2
    claims = [q.claim("w") for _ in range(3)]
    assert [c.index for c in claims] == [0, 1, 2] and [c.batch for c in claims] == ["b", "c", "a"]
    assert not q.done
    for c in reversed(claims):
        q.complete(c)
    assert q.done and q.claim("w") is None and q.wait(timeout=0)
    assert q.completed_by == {"w": 3}


def test_released_claim_is_handed_out_again_and_stale_claims_are_refused():
    q = MicroStepQueue(1)
    q.put("x")
    first = q.claim("satellite")
    q.release(first)  # the satellite failed or left
    second = q.claim("core")
    assert (second.index, second.batch, second.attempt) == (0, "x", 1)
    with pytest.raises(ValueError, match="not claimed by this claim"):
        q.complete(first)  # the old claim cannot complete the slot any more
    q.complete(second)
    assert q.done and q.released == 1 and q.completed_by == {"core": 1}


def test_close_leaves_unfilled_slots_empty():
    q = MicroStepQueue(4)
    q.put("a")
    c = q.claim("w")
    q.complete(c)
    assert not q.done and q.empty_slots() == []  # more may come
    q.close()
    assert q.done and q.empty_slots() == [1, 2, 3] and q.filled() == [0]
    with pytest.raises(ValueError, match="after close"):
        q.put("late")


def test_bad_puts_are_refused_with_clear_errors():
    q = MicroStepQueue(2)
    q.put("a", index=1)
    with pytest.raises(ValueError, match="already filled"):
        q.put("b", index=1)
    with pytest.raises(ValueError, match="outside"):
        q.put("b", index=2)
    q.put("b")
    with pytest.raises(ValueError, match="micro_steps_per_step"):
        q.put("c")
    with pytest.raises(ValueError, match=">= 1"):
        MicroStepQueue(0)


def test_claim_times_out_with_a_description_and_abort_wakes_waiters():
    q = MicroStepQueue(2)
    with pytest.raises(TimeoutError, match="pending"):
        q.claim("w", timeout=0.01)
    raised = []

    def waiter():
        try:
            q.claim("w")
        except QueueAborted as e:
            raised.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    q.abort(RuntimeError("core failed"))
    th.join(timeout=scaled(10))
    assert not th.is_alive() and len(raised) == 1 and "core failed" in str(raised[0])
    with pytest.raises(QueueAborted):
        q.put("x")


def test_a_claim_blocks_until_a_producer_puts():
    q = MicroStepQueue(1)
    got = []
    th = threading.Thread(target=lambda: got.append(q.claim("w", timeout=scaled(30))))
    th.start()
    q.put("late batch")
    th.join(timeout=scaled(30))
    assert got[0].batch == "late batch"


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), workers=st.integers(1, 4), fail_every=st.integers(0, 3), seed=st.integers(0, 1000))
def test_concurrent_workers_complete_every_slot_exactly_once(n, workers, fail_every, seed):
    """Workers claim concurrently while a producer fills slots in a shuffled order; some claims fail and are
    released. Every filled slot is completed exactly once, by someone."""
    import random

    q = MicroStepQueue(n)
    completed: list[int] = []
    lock = threading.Lock()
    order = list(range(n))
    random.Random(seed).shuffle(order)

    def work(name, k):
        count = 0
        while (c := q.claim(name, timeout=scaled(30))) is not None:
            count += 1
            if fail_every and k == 0 and count % (fail_every + 1) == 0:
                q.release(c)  # worker 0 gives some claims back
                continue
            with lock:
                completed.append(c.index)
            q.complete(c)

    threads = [threading.Thread(target=work, args=(f"w{k}", k)) for k in range(workers)]
    for th in threads:
        th.start()
    for i in order:
        q.put(f"mb{i}", index=i)
    for th in threads:
        th.join(timeout=scaled(60))
    assert not any(th.is_alive() for th in threads)
    assert sorted(completed) == list(range(n))
    assert sum(q.completed_by.values()) == n and q.done
