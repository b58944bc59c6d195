"""Bad model input through the CLI (issue 19 item 8): one row per broken checkpoint, with the line the run printed
and its exit code, and a run where every execution is excluded (its evaluator crashes).

``run(quick, seed, workdir)``: ``quick=False`` runs ``python -m gyre_jax.train`` for every bad input; ``quick=True``
runs the CLI for the tokenizer case and the untrained run, and calls the trainer's loading functions for the rest
(the CLI prints the same message as ``error: <message>`` with exit 2: the tokenizer row shows that path).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("_model_util", REPO / "tests" / "faults" / "_model_util.py")
mu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mu)

TEST = "tests/faults/test_bad_model_input.py"
SMALL = ["--config.warm_start.steps=0", "--config.eval.samples_per_task=0", "--config.rollout.tasks_per_step=1",
         "--config.rl.group_size=2", "--config.metrics.progress_bar=false", "--config.devices.num_cpu_devices=1",
         "--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.cells.num_cells=1", "--config.cells.data=1"]  # fmt: skip
UNTRAINED = ["--config.total_steps=6", "--config.rollout.harness=command",
             "--config.rollout.harness_cmd=sh -c 'rm -rf {workspace}'", "--config.rl.max_untrained_steps=2"]  # fmt: skip


def _cli(workdir: Path, args: list[str]) -> tuple[int, str, str, float]:
    """(exit code, the last line it printed: stderr's on failure, stdout's on success, stdout, seconds) of one
    ``python -m gyre_jax.train`` run."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "gyre_jax.train", f"--config.workdir={workdir}", *SMALL, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = proc.stderr.strip().splitlines() if proc.returncode else proc.stdout.strip().splitlines()  # "done: ..."
    return proc.returncode, lines[-1] if lines else "", proc.stdout, time.time() - t0


def _direct(ckpt: Path) -> tuple[int, str]:
    """(the exit code the CLI maps it to, the line it would print) from the trainer's loading functions."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from gyre_jax import config as config_lib
    from gyre_jax.model.config import ModelInputError
    from gyre_jax.model.hf_checkpoint import load_hf_params, read_model_config
    from gyre_jax.model.hf_tokenizer import HFTokenizer, check_fits_model

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    try:
        cfg = read_model_config(ckpt)
        check_fits_model(HFTokenizer.from_dir(ckpt), cfg.vocab_size, str(ckpt / "config.json"))
        load_hf_params(ckpt, cfg, mesh, config_lib.default_config().sharding_rules)
    except ModelInputError as exc:
        return 2, f"error: {exc}"
    return 0, f"loaded ({cfg.rope_type} rope, original max position {cfg.rope_original_max_position})"


def _input_row(name: str, root: Path, use_cli: bool) -> dict:
    make, words = mu.BAD_INPUTS[name]
    ckpt = mu.copy_fixture(root / name / "ckpt")
    make(ckpt)
    if use_cli:
        code, line, _, secs = _cli(root / name / "run", [f"--config.model.checkpoint_dir={ckpt}", "--config.tokenizer.kind=hf",
                                                      "--config.total_steps=1"])  # fmt: skip
        command = f"python -m gyre_jax.train --config.model.checkpoint_dir=<{name}> --config.tokenizer.kind=hf"
    else:
        (code, line), secs = _direct(ckpt), 0.0
        command = f"pytest {TEST} -k {name}" if words else f"pytest {TEST}::test_the_older_yarn_spelling_loads"
    wanted = 2 if words else 0
    ok = code == wanted and all(w in line for w in words) and "\n" not in line
    return {"fault": f"model input: {name}", "injected": 1, "lost": 0, "double_counted": 0,
            "outcome": "ok" if ok else "fails", "printed": f"exit {code}: {line}", "command": command,
            "needs": "" if ok else "issue 19 item 8", "seconds": round(secs, 1)}  # fmt: skip


def _untrained_row(root: Path) -> dict:
    code, line, stdout, secs = _cli(root / "untrained", UNTRAINED)
    steps = sum(x.startswith("step ") for x in stdout.splitlines())
    ok = code == 3 and line.startswith("error: stopping: 2 consecutive RL steps") and "done:" not in stdout
    return {"fault": "every execution excluded (evaluator crashes: harness deletes its workspace)",
            "injected": 2 * steps, "lost": 0, "double_counted": 0, "outcome": "ok" if ok else "fails",
            "printed": f"exit {code}: {line}", "command": "python -m gyre_jax.train " + " ".join(SMALL + UNTRAINED),
            "needs": "" if ok else "issue 19 item 8", "seconds": round(secs, 1)}  # fmt: skip


def run(quick: bool, seed: int, workdir: Path) -> dict:
    """One row per bad model input and one for the run that trains nothing (``seed`` is unused: nothing random)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [
        _input_row(name, workdir, use_cli=not quick or name == "tokenizer_larger_than_vocab") for name in mu.BAD_INPUTS
    ]
    rows.append(_untrained_row(workdir))
    seconds = {r["fault"]: r.pop("seconds") for r in rows}
    return {"rows": rows, "extra": {"seconds": seconds, "quick": quick}}


if __name__ == "__main__":
    import json
    import tempfile

    out = run("--full" not in sys.argv, 0, Path(tempfile.mkdtemp(prefix="model_input_")))
    for row in out["rows"]:
        print(json.dumps(row))
    print(json.dumps(out["extra"]))
