"""What the commands around a run share (``python -m gyre_jax.evaluate``, ``serve``, ``export``): which policy they
take, the run config it comes with, and its params on this process's devices.

A policy is named one of two ways (``PolicySource``):

- ``--run DIR [--step K]``: a run directory's checkpoint ``K`` (default: its latest), with the run's own config
  (``DIR/config.json``; ``--config.a.b=v`` overrides apply on top, e.g. another suite split or port). Any layer
  layout (``model.scan_layers`` on or off) and any process count: ``layer_stack.restore`` reads either layout,
  and a multi-process run's checkpoint holds whole arrays (process 0 saves them);
- ``--checkpoint REF``: a Hugging Face directory, a GGUF file or ``pkg:<package>/<file>`` (``model.checkpoint_dir``,
  docs/model.md), with ``--config FILE`` (default ``configs/tiny_cpu.py``) and overrides; the tokenizer defaults to
  the checkpoint's own (``tokenizer.kind`` "gguf" for a GGUF file, "hf" for a directory) unless set.

Every problem with the arguments, the config, the run directory or the checkpoint is one ``error:`` line and exit
status 2, before any work (``CommandError``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_jax import build
from gyre_jax import config as config_lib
from gyre_jax.checkpoint import Checkpointer
from gyre_jax.config.files import apply_override, parse_args
from gyre_jax.config.run import RETIRED_KEYS, RunConfig
from gyre_jax.model import layer_stack
from gyre_jax.model.checkpoints import is_gguf, reference_problem
from gyre_jax.progress import Progress
from gyre_jax.rl.learner import Learner
from gyre_jax.serving.types import GenerationRequest, SamplingParams

log = logging.getLogger("gyre_jax")

EXIT_USAGE = 2


class CommandError(Exception):
    """Bad arguments, config, run directory or checkpoint: one line, exit status 2, before any work."""


@dataclass(frozen=True)
class PolicySource:
    """Where the policy comes from: a run directory's checkpoint (``run``, ``step`` None = the latest) or a model
    checkpoint reference (``checkpoint``: HF directory, GGUF file, ``pkg:``), or neither (the config's own model:
    ``model.checkpoint_dir`` or a random init)."""

    run: Path | None = None
    step: int | None = None
    checkpoint: str | None = None

    def describe(self) -> str:
        if self.run is not None:
            return f"{self.run} step {self.step if self.step is not None else 'latest'}"
        return self.checkpoint or "the config's model"


def add_policy_args(parser: argparse.ArgumentParser) -> None:
    """``--run DIR``, ``--step K``, ``--checkpoint REF`` and ``--config FILE`` (``--config.a.b=v`` overrides are
    collected by ``parse_known``)."""
    group = parser.add_argument_group("policy (one of)")
    group.add_argument("--run", type=Path, help="a run directory (python -m gyre_jax.train's workdir)")
    group.add_argument("--step", type=int, help="with --run: the checkpoint's step (default: the latest)")
    group.add_argument("--checkpoint", help="a Hugging Face directory, a GGUF file or pkg:<package>/<file>")
    parser.add_argument("--config", "-c", help="config file (with --checkpoint; default configs/tiny_cpu.py)")
    parser.add_argument("--warmup", choices=WARMUPS, default="first",
                        help="compile before serving: what a first call runs (default), every shape, or nothing")  # fmt: skip


def parse_known(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's own arguments, and the ``--config.a.b=v`` overrides (anything else is an error)."""
    args, rest = parser.parse_known_args(argv)
    overrides = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--config."):
            raise CommandError(f"unrecognized argument {arg!r} (see --help; config keys go as --config.a.b=value)")
        if "=" not in arg:
            if i + 1 >= len(rest):
                raise CommandError(f"{arg} needs a value: {arg}=VALUE")
            overrides += [arg, rest[i + 1]]
            i += 2
            continue
        overrides.append(arg)
        i += 1
    return args, overrides


def policy_source(args: argparse.Namespace) -> PolicySource:
    """The policy the arguments name (see the module docstring); CommandError for a bad combination."""
    if args.run is not None and args.checkpoint is not None:
        raise CommandError("give --run DIR (a run's checkpoint) or --checkpoint REF (a model checkpoint), not both")
    if args.step is not None and args.run is None:
        raise CommandError("--step needs --run DIR (the run directory whose checkpoint it names)")
    if args.run is not None:
        if args.config is not None:
            raise CommandError("--run uses the run's own config (DIR/config.json): drop --config, keep --config.a.b=v")
        if not (args.run / "config.json").is_file():
            raise CommandError(
                f"{args.run}/config.json not found: is {args.run} a run directory (python -m gyre_jax.train)?"
            )
        if args.step is not None and args.step < 0:
            raise CommandError(f"--step={args.step} must be >= 0")
        return PolicySource(run=args.run, step=args.step)
    if args.checkpoint is not None:
        problem = reference_problem(args.checkpoint)
        if problem:
            raise CommandError(problem)
    return PolicySource(checkpoint=args.checkpoint)


def load_config(source: PolicySource, config_file: str | None, overrides: list[str]) -> RunConfig:
    """The config the policy runs with (see the module docstring); CommandError naming a bad key or value."""
    try:
        if source.run is not None:
            config = RunConfig.from_config_dict(json.loads((source.run / "config.json").read_text())).to_config_dict()
            _, pairs = parse_args(overrides)
            for key, value in pairs:
                apply_override(config, key, value, RETIRED_KEYS)
            return RunConfig.from_config_dict(config)
        argv = ([] if config_file is None else ["--config", config_file]) + list(overrides)
        if source.checkpoint is not None:
            argv.append(f"--config.model.checkpoint_dir={source.checkpoint}")
            _, pairs = parse_args(overrides)
            if not any(key == "tokenizer.kind" for key, _ in pairs):
                kind = "gguf" if is_gguf(source.checkpoint) or source.checkpoint.endswith(".gguf") else "hf"
                argv.append(f"--config.tokenizer.kind={kind}")
        return config_lib.load_config(argv)
    except config_lib.ConfigError as exc:
        raise CommandError(str(exc)) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CommandError(f"{source.run}/config.json cannot be read: {exc}") from None


def checkpoint_step(run: Path, step: int | None) -> int:
    """The run's checkpoint ``step`` (None: the latest), checked to exist; CommandError listing the steps kept."""
    directory = run / "checkpoints"
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []
    if not steps:
        raise CommandError(f"{directory}: no checkpoint (the run saves one at its start and every checkpoint_every)")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CommandError(
            f"{run}: no checkpoint of step {step}; it keeps steps {steps} (config.keep_checkpoints keeps the last few)"
        )
    return step


def policy_params(s: build.Setup, source: PolicySource) -> tuple[Any, int, str]:
    """The policy's params on the core cell's mesh, its policy version and what it is, for logs: a run's checkpoint
    (restored in the model's layout), or the model ``build.setup`` loaded (the checkpoint reference or the config's
    random init)."""
    c = s.config
    learner = Learner(s.model_cfg, s.graphdef, s.cells[0].mesh, s.rules, c.optimizer, loss_cfg=c.loss_config())
    if source.run is None:
        params = build.core_params(s, s.params)
        s.params = None
        return learner.init_state(params).params, 0, source.describe()
    step = checkpoint_step(source.run, source.step)
    checkpointer = Checkpointer(source.run / "checkpoints", max_to_keep=10**6)  # saves nothing: deletes nothing
    try:
        state, meta = layer_stack.restore(checkpointer, step, learner.abstract_state())
    finally:
        checkpointer.close()
    s.params = None
    version = int(meta.get("policy_version", int(state.step)))
    return state.params, version, f"{source.run} checkpoint {step} (policy version {version})"


def setup_logging() -> None:
    """The run's log format (``python -m gyre_jax.train``'s), quiet libraries."""
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S", force=True)
    for noisy in ("absl", "jax", "orbax", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def fail(message: str) -> int:
    """Prints ``error: message`` and returns the usage exit status."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


WARMUPS = ("first", "full", "none")


def start_cells(s: build.Setup, params: Any, version: int, warmup: str) -> list:
    """Every cell serving ``params`` (``build.serving_cells``), warmed as ``warmup`` says: "first" compiles what an
    agent's first calls run (``first_conversation``: seconds to a few minutes on a loaded CPU), "full"
    every program shape the loop can dispatch (``serving.warmup``: minutes on a loaded CPU), "none" nothing (the
    first calls compile, inside their harnesses' time limits). With progress."""
    if warmup not in WARMUPS:
        raise CommandError(f"--warmup={warmup!r} must be one of {WARMUPS}")
    with Progress("starting the cells", total=len(s.cells), unit="cells", delay_s=1.0) as progress:
        cells = build.serving_cells(s, params, version, warm=warmup == "full", on_cell=lambda c: progress.update(1))
    if warmup == "first":
        with Progress("compiling a first conversation", total=len(cells), unit="cells", delay_s=1.0) as progress:
            for cell in cells:  # one after another: each cell is its own mesh, its own programs
                first_conversation(cell, s.tokenizer, s.config.serving.max_prefill_length)
                progress.update(1)
    return cells


def first_conversation(cell, tokenizer, max_prefill: int) -> None:
    """Two calls of one session on ``cell``, then its sessions dropped: a prompt longer than a prefill chunk (chunked
    prefill, decoding, the session's KV kept), then the same prompt extended (the session's prefix reused): the
    programs an agent's first calls run, compiled before any harness's time limit starts."""
    unit = tokenizer.encode("Hello, this is a warm-up. ")
    prompt = (unit * (max_prefill // max(1, len(unit)) + 2))[: max_prefill + max_prefill // 2]
    sampling = SamplingParams(max_tokens=2, seed=0)
    first = cell.submit(GenerationRequest(prompt, sampling, session_id="gyre-warmup")).result()
    follow = prompt + list(first.token_ids) + unit
    cell.submit(GenerationRequest(follow, sampling, session_id="gyre-warmup")).result()
    cell.drop_sessions()
