"""Nothing refused or untrained in silence, through ``python -m gyre_jax.train`` as a user runs it.

A harness whose every model call is refused (a prompt over the context) and that then crashes: the step line counts
the refused calls by why and the executions the pipeline left out, the metrics (and TensorBoard) hold the same
counts, the run of one step, shorter than ``rl.max_untrained_steps``, exits 3 with the line saying why, and
``python -m gyre_jax.audit`` says that nothing was trained, agreeing with the metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--config", "configs/tiny_cpu.py", "--config.total_steps=1", "--config.warm_start.steps=0",
        "--config.rollout.tasks_per_step=1", "--config.rl.group_size=2", "--config.eval.samples_per_task=0",
        "--config.metrics.progress_bar=false", "--config.model.num_layers=1", "--config.model.embed_dim=32",
        "--config.model.mlp_dim=64", "--config.model.head_dim=8"]  # fmt: skip

# A harness that sends one prompt of 5,000 bytes (over the tiny config's 1,024-token context of the byte tokenizer),
# reports the proxy's answer and exits 1, as a harness does that cannot go on.
OVERFLOWING_HARNESS = """\
import json, os, sys, urllib.error, urllib.request
body = {"model": sys.argv[1], "messages": [{"role": "user", "content": "x" * 5000}]}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
try:
    urllib.request.urlopen(request, timeout=120)
except urllib.error.HTTPError as exc:
    print(exc.code, exc.read().decode(), file=sys.stderr)
    sys.exit(1)
"""


def _scalar_tags(directory: Path) -> set[str]:
    """The scalar tags in a directory's TensorBoard event files (TFRecord framing: length, its CRC, data, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    tags = set()
    for path in directory.glob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            length = int.from_bytes(data[at : at + 8], "little")
            event = Event.FromString(data[at + 12 : at + 12 + length])
            tags |= {value.tag for value in event.summary.value}
            at += 12 + length + 4
    return tags


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "gyre_jax.train", *TINY, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


@pytest.mark.slow
def test_refused_calls_and_crashed_harnesses_are_counted_and_an_untrained_short_run_exits_3(tmp_path: Path) -> None:
    script = tmp_path / "overflow.py"
    script.write_text(OVERFLOWING_HARNESS)
    workdir = tmp_path / "run"
    proc = _train(f"--config.workdir={workdir}", "--config.rollout.harness=command",
                  f"--config.rollout.harness_cmd={sys.executable} {script} {{model}}")  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("step 1/1")]
    assert "crashed 2" in line and "refused 2 (context 2)" in line and "left out 2 (no records 2)" in line, line
    assert "trained 0" in line and "tokens 0" in line, line
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: the run ended, but: 1 consecutive RL steps (1..1) trained nothing: every execution failed (2: crashed "
        "2, no recorded model call 2; model calls refused: context 2)"
    ), last
    assert "harness exited 1, model calls refused: context 1" in last and "Exit code 3." in last
    # the trainer's warning says what happened: no records, not "corrupt"
    assert "excluded from training: no records:" in proc.stderr and "corrupt records" not in proc.stderr
    # each result records its calls; the stderr of the harness holds the API's own wording of the overflow
    results = [json.loads(x) for x in (workdir / "results" / "step_000000.jsonl").read_text().splitlines()]
    assert [(r["status"], r["model_calls"], r["refused_calls"]) for r in results] == [
        ("crashed", 0, {"context": 1, "admission": 0, "bad_request": 0})
    ] * 2
    stderr = (Path(results[0]["workspace"]).parent / "harness.stderr").read_text()
    assert "This model's maximum context length is 1024 tokens" in stderr and "context_length_exceeded" in stderr
    # metrics.jsonl (and TensorBoard) hold the counts
    [m] = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if '"phase": "train"' in x]
    assert (m["refused_context"], m["crashed"], m["no_model_calls"], m["executions_trained"]) == (2, 2, 2, 0)
    assert m["left_out/no_records"] == 2
    assert {"refused_context", "left_out/no_records", "executions_trained"} <= _scalar_tags(workdir / "tensorboard")
    # the audit agrees with the metrics: 2 executions run, none trained
    audit = subprocess.run([sys.executable, "-m", "gyre_jax.audit", str(workdir), "--json"], cwd=REPO,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    report = json.loads(audit.stdout)
    assert audit.returncode == 0 and report["ok"], audit.stdout + audit.stderr
    assert (report["executions_run"], report["executions_trained"], report["tokens_trained"]) == (2, 0, 0)
    assert report["refused_calls"] == {"context": 2, "admission": 0, "bad_request": 0}
    assert report["left_out"] == {"no_records": 2} and report["crashed"] == 2
    line = subprocess.run([sys.executable, "-m", "gyre_jax.audit", str(workdir)], cwd=REPO, capture_output=True,
                          text=True, timeout=300).stdout  # fmt: skip
    assert "2 executions run, 0 trained (0 tokens)" in line and "refused calls 2 (context 2)" in line, line
