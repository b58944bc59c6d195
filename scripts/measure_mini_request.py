"""How big mini-swe-agent's first request is with the ``mini-swe-agent`` preset's compact config versus mini's own
``mini.yaml``: the real CLI against the real proxy over the scripted backend of ``measure_claude_request.py``, byte
tokenizer (1 token per byte of the rendered prompt), for the proxy's ``qwen3`` and ``compact`` tool formats.

Run: ``PYTHONPATH=$PWD python scripts/measure_mini_request.py``. Offline; a few seconds per run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_claude_request import BYTES, INSTRUCTION, ScriptedBackend  # noqa: E402

from gyre_jax.proxy.records import RecordStore  # noqa: E402
from gyre_jax.proxy.server import ProxyServer  # noqa: E402
from gyre_jax.rollout import templates  # noqa: E402
from gyre_jax.rollout.harnesses import fill_spec, harness_spec, write_files  # noqa: E402


def run(proxy: ProxyServer, store: RecordStore, exec_dir: Path, own_config: bool) -> dict:
    """One step of mini-swe-agent (the preset; with ``own_config`` False, mini.yaml in place of ours)."""
    (exec_dir / "workspace").mkdir(parents=True)
    values = {"{task.instruction}": INSTRUCTION, "{model}": "gyre-tiny", "{max_turns}": "1", "{max_tokens}": "24",
              "{exec_dir}": str(exec_dir), "{base_url}": proxy.base_url}  # fmt: skip
    argv, env, files = fill_spec(harness_spec("mini-swe-agent"), values)
    write_files(files, exec_dir)
    if not own_config:
        at = argv.index("-c") + 1
        argv[at : at + 1] = ["mini.yaml", "-c", f"model.model_kwargs.api_base={proxy.base_url}",
                             "-c", "agent.step_limit=1", "-c", "agent.cost_limit=0"]  # fmt: skip
    key = proxy.open_execution(exec_dir.name)
    done = subprocess.run(argv, cwd=exec_dir / "workspace", env=templates.harness_env(key, proxy.base_url, env),
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    records = store.read(exec_dir.name)
    return {"exit": done.returncode, "calls": len(records),
            "first_prompt_tokens": len(records[0].prompt_ids) if records else None}  # fmt: skip


def main() -> None:
    backend = ScriptedBackend()
    root = Path(tempfile.mkdtemp(prefix="mini-measure-"))
    store = RecordStore(root / "records")
    for tools_format in ("qwen3", "compact"):
        with ProxyServer(backend, BYTES, store, model_name="gyre-tiny", max_request_bytes=16 << 20,
                         tools_format=tools_format, max_tokens_cap=200) as proxy:  # fmt: skip
            for config, own in (("ours", True), ("mini.yaml", False)):
                result = run(proxy, store, root / f"{tools_format}-{config.replace('.', '-')}", own)
                print(json.dumps({"tools_format": tools_format, "config": config, **result}), flush=True)
    backend.shutdown()


if __name__ == "__main__":
    main()
