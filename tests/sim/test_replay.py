"""Tests for gyre_jax/sim/replay.py: a recorded event sequence through the simulator's books.

The simulator logs its decisions in the real run's ``decisions.jsonl`` format (through the controller's
``Driver``); replaying them through the books alone gives the same state at every decision and a fresh
policy the same decisions, and a state that was built another way is reported field by field. (The same
replay on a real run's decisions: ``tests/elastic/test_controller.py``.)
"""

from __future__ import annotations

import pytest

from gyre_jax.elastic.events import event_from_dict
from gyre_jax.elastic.policies import make_policy
from gyre_jax.elastic.state import state_from_dict
from gyre_jax.sim.config import load_sim_config
from gyre_jax.sim.replay import main, read_decisions, replay
from gyre_jax.sim.simulator import Simulator


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The tiny preset with ahead executions yielding their slots: sessions are held while cells leave."""
    cfg = load_sim_config("tiny").replace(policy_options={"dispatch_staleness": 2, "yield_ahead": True})
    path = tmp_path_factory.mktemp("replay") / "decisions.jsonl"
    Simulator(cfg, decisions_path=str(path)).run()
    return cfg, read_decisions(path)


def _policy(cfg):
    return make_policy(cfg.policy, cfg.num_cells, **dict(cfg.policy_options))


def _shape(cfg):
    return dict(steps=cfg.steps, batch_size=cfg.batch_size, slots=cfg.slots_per_cell)


def test_the_simulators_decisions_replay_alone_and_through_its_books(recorded):
    cfg, lines = recorded
    kinds = {line["event"]["kind"] for line in lines}
    assert kinds >= {"step_began", "started", "finished", "data_ready", "micro_step_done", "switched", "step_trained"}
    assert sum(line["state"]["held"] > 0 for line in lines) > 10  # sessions waited for a slot
    policy = _policy(cfg)  # the policy alone on the logged events and states decides the same
    for line in lines:
        d = policy.plan(event_from_dict(line["event"]), state_from_dict(line["state"]))
        assert ([r.value for r in d.roles], d.dispatch) == (line["roles"], line["dispatch"])
    assert replay(lines, _policy(cfg), **_shape(cfg)) == []  # the books give the same states


@pytest.mark.parametrize(
    "field, change",
    [
        ("held", lambda s: {**s, "held": 0}),
        ("due_outstanding", lambda s: {**s, "due_outstanding": s["due_outstanding"] + 1}),
        ("waterlevel", lambda s: {**s, "waterlevel": {**s["waterlevel"], "started": s["waterlevel"]["started"] - 1}}),
        ("roles", lambda s: {**s, "roles": ["serving"] * len(s["roles"])}),
    ],
)
def test_a_state_built_another_way_is_reported(recorded, field, change):
    cfg, lines = recorded
    at = next(i for i, line in enumerate(lines) if line["state"]["held"] > 0 and "serving" != line["state"]["roles"][0])
    broken = [dict(line, state=change(line["state"])) if i == at else line for i, line in enumerate(lines)]
    found = replay(broken, _policy(cfg), **_shape(cfg))
    assert found and found[0].line == at and field in found[0].fields
    assert found[0].fields[field][0] == change(lines[at]["state"])[field]  # (recorded, simulator)
    assert field in str(found[0])


def test_a_decision_taken_otherwise_is_reported(recorded):
    cfg, lines = recorded
    at = next(i for i, line in enumerate(lines) if line["dispatch"] > 0)
    broken = [dict(line, dispatch=line["dispatch"] + 1) if i == at else line for i, line in enumerate(lines)]
    found = replay(broken, _policy(cfg), **_shape(cfg))
    assert found[0].line == at and found[0].fields["dispatch"] == (lines[at]["dispatch"] + 1, lines[at]["dispatch"])


def test_the_command_line_needs_a_run_directory(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "decisions.jsonl not found" in capsys.readouterr().err


def test_an_event_the_books_cannot_place_is_an_error(recorded):
    cfg, lines = recorded
    first_finished = next(i for i, line in enumerate(lines) if line["event"]["kind"] == "finished")
    wrong = dict(lines[first_finished], event={**lines[first_finished]["event"], "step": cfg.steps - 1})
    with pytest.raises(ValueError, match=f"an execution of step {cfg.steps - 1} finished but none"):
        replay([*lines[:first_finished], wrong], _policy(cfg), **_shape(cfg))
    with pytest.raises(ValueError, match="one segment from step 0"):
        replay([dict(lines[0], event={**lines[0]["event"], "step": 3})], _policy(cfg), **_shape(cfg))
