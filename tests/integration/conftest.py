"""Shared fixtures for the integration tests: a tiny model served by the real engine behind the real proxy.

One session-wide stack (compiled once): a byte-level BPE tokenizer trained here on this checkout's own
docs and sources (with Qwen3's special tokens; about 2.9 characters per token, so a coding CLI's
request of about 36 KB rendered text is about 12K tokens instead of 36K bytes), a 2-layer Qwen3-style
model on a 4-device cell submesh (random weights, then 40 Adam steps teaching it to answer
``Done.<|im_end|>`` after any context, so agent turns end instead of running to the token cap), ``Engine`` + ``ServingLoop`` (chunked prefill,
session prefix cache), a ``Router``, and the ``ProxyServer`` on 127.0.0.1. The model emits garbage;
what these tests check is the plumbing: that real clients run to their end against it, and that the
records hold exactly the tokens the clients were served.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from timelimits import scaled

from gyre_jax.config import load_config
from gyre_jax.model.attention import segment_causal_mask
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.sharding import init_params, make_mesh
from gyre_jax.model.tokenizer import SPECIAL_TOKENS
from gyre_jax.proxy.chat_template import ParsedCompletion, parse_completion
from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.proxy.router import Router
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.engine import Engine
from gyre_jax.serving.loop import ServingLoop
from gyre_jax.trajectory.pipeline import LoadedExecution, LoadExecution, TrajectoryConfig
from gyre_jax.trajectory.queue import QueuedExecution

REPO = Path(__file__).resolve().parents[2]
NPM_DIR = Path(__file__).resolve().parent / "npm"
MODEL = "gyre-tiny"
VOCAB = 4096
MAX_SEQ_LEN = 16384  # a Claude Code request is about 12K tokens of this tokenizer
MAX_TOKENS_CAP = 24  # completion budget of every call: random weights rarely sample <|im_end|>


class BpeTokenizer:
    """A ``tokenizers`` byte-level BPE with Qwen3's special tokens, in the interface the proxy uses."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        token_id = self.tok.token_to_id(token)
        if token_id is None:
            raise KeyError(f"{token!r} is not in the vocabulary")
        return token_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.token_id("<|im_end|>"), self.token_id("<|endoftext|>"))


def train_tokenizer(vocab_size: int = VOCAB) -> BpeTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = sorted(glob.glob(str(REPO / "gyre_jax" / "**" / "*.py"), recursive=True))
    corpus += sorted(glob.glob(str(REPO / "docs" / "*.md"))) + [str(REPO / "README.md")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train(corpus, trainer)
    return BpeTokenizer(tok)


ANSWER = "Done."


def brief_training(graphdef, params, tokenizer: BpeTokenizer, steps: int = 40, batch: int = 8, length: int = 64):
    """Teaches the random model to answer ``ANSWER<|im_end|>`` after ``<|im_start|>assistant\n`` whatever came
    before (random token contexts).

    The attention output projections are scaled down to 2% and frozen first: the model then behaves
    nearly as a bigram model, so what it learned on 64-token contexts holds on 13K-token prompts
    (attention still runs over the whole KV cache and still moves the log-probs a little).
    """
    rng = np.random.default_rng(0)
    tail = tokenizer.encode("<|im_start|>assistant\n" + ANSWER + "<|im_end|>")
    answer_len = len(tokenizer.encode(ANSWER + "<|im_end|>"))
    tokens = np.zeros((batch, length), np.int32)
    weights = np.zeros((batch, length), np.float32)  # on the targets (next tokens) of the answer
    segments = np.zeros((batch, length), np.int32)
    for row in range(batch):
        n = int(rng.integers(8, length - len(tail)))
        seq = rng.integers(len(SPECIAL_TOKENS), tokenizer.vocab_size, size=n).tolist() + tail
        tokens[row, : len(seq)] = seq
        segments[row, : len(seq)] = 1
        weights[row, len(seq) - answer_len - 1 : len(seq) - 1] = 1.0
    tokens, weights, segments = jnp.asarray(tokens), jnp.asarray(weights), jnp.asarray(segments)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    optimizer = optax.adam(2e-2)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    params = jax.device_put(params, jax.devices()[0])  # one device: faster than 4 virtual ones for this size
    frozen = jax.tree_util.tree_map_with_path(lambda path, _: "o_proj" in jax.tree_util.keystr(path), params)
    params = jax.tree.map(lambda x, f: x * 0.02 if f else x, params, frozen)

    def loss_fn(p):
        logits, _ = nnx.merge(graphdef, p)(tokens, positions, segment_causal_mask(segments))
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * weights[:, :-1]) / jnp.sum(weights)

    @jax.jit
    def step(p, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        grads = jax.tree.map(lambda g, f: jnp.zeros_like(g) if f else g, grads, frozen)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    opt_state = optimizer.init(params)
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
    assert float(loss) < 0.1, f"brief training did not converge (loss {float(loss):.3f})"
    return jax.device_put(params, shardings)


class Stack:
    """The running stack: proxy (with ``base_url``), router, loop, tokenizer and record store."""

    def __init__(
        self, proxy: ProxyServer, router: Router, loop: ServingLoop, tokenizer: BpeTokenizer, records: RecordStore
    ):
        self.proxy, self.router, self.loop, self.tokenizer, self.records = proxy, router, loop, tokenizer, records

    def completion_text(self, record: TitoRecord) -> str:
        ids = record.completion_ids
        if record.finish_reason == "stop" and ids and ids[-1] in self.tokenizer.eos_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    def parsed(self, record: TitoRecord) -> ParsedCompletion:
        """What the client was served, re-derived from the record's token ids alone."""
        return parse_completion(self.completion_text(record))

    def parsed_turn(self, record: TitoRecord) -> ParsedCompletion:
        """``parsed``, for a turn whose prompt already opened the reply: under a forced ``tool_choice`` the
        proxy ends the prompt with the tool call's opener (recorded as prompt, never trained), so the client
        was served that text + the completion, parsed as the proxy parses a forced turn."""
        opened = self.tokenizer.decode(record.prompt_ids).rsplit("<|im_start|>assistant\n", 1)[-1]
        if "<tool_call>" not in opened:
            return self.parsed(record)
        from gyre_jax.proxy.turns import parse_forced  # forced tool_choice: issue 15 (branch i15-sampling)

        return parse_forced(opened + self.completion_text(record), parse_tools=True)

    def trainer_load(self, execution_id: str) -> LoadedExecution:
        """The execution's records as the trainer reads them (``LoadExecution``: strict reader, then branches);
        ``.excluded`` says why when it would not train on them."""
        config = TrajectoryConfig(
            vocab_size=self.tokenizer.vocab_size, message_end_id=self.tokenizer.token_id("<|im_end|>")
        )
        entry = QueuedExecution(
            index=0, execution_id=execution_id, step=0, advantage=1.0, weight=1.0, last_in_step=True
        )
        return LoadExecution(self.records.root, config).map(entry)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tokenizer = train_tokenizer()
    assert tokenizer.vocab_size == VOCAB
    cfg = ModelConfig(vocab_size=VOCAB, num_layers=2, embed_dim=64, num_heads=2, num_kv_heads=1, head_dim=32,
                      mlp_dim=128, rope_theta=10_000.0)  # fmt: skip
    rules = tuple((k, v) for k, v in load_config([]).sharding_rules)
    mesh = make_mesh(jax.devices()[4:8], dict(data=4))
    graphdef, params = init_params(cfg, mesh, rules, seed=0)
    params = brief_training(graphdef, params, tokenizer)
    engine = Engine(cfg, graphdef, mesh, rules, max_concurrent_decodes=4, max_seq_len=MAX_SEQ_LEN,
                    max_prefill_length=1024, prefill_buckets=(128, 1024))  # fmt: skip
    loop = ServingLoop(engine, params, policy_version=0, name="cell0", seed=0, detokenize=tokenizer.decode).start()
    router = Router({"cell0": loop})
    records = RecordStore(tmp_path_factory.mktemp("records"))
    proxy = ProxyServer(router, tokenizer, records, model_name=MODEL, tools_format="compact", max_tokens_cap=MAX_TOKENS_CAP,
                        max_request_bytes=1024 * 1024, seed=0).start()  # fmt: skip
    try:
        yield Stack(proxy, router, loop, tokenizer, records)
    finally:
        proxy.stop()
        loop.stop()
        assert loop.error is None, loop.error


# The npm CLIs the tests drive: executable name -> npm package (versions pinned in npm/package.json + lockfile).
NPM_CLIS = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex", "opencode": "opencode-ai",
            "qwen": "@qwen-code/qwen-code"}  # fmt: skip
AIDER_REQUIREMENTS = Path(__file__).resolve().parent / "requirements-aider.txt"


def npm_installed_version(package: str) -> str | None:
    manifest = NPM_DIR / "node_modules" / package / "package.json"
    return json.loads(manifest.read_text())["version"] if manifest.exists() else None


@pytest.fixture(scope="session")
def npm_bins() -> dict[str, Path]:
    """The npm CLIs (``NPM_CLIS``: Claude Code, Codex CLI, opencode, Qwen Code) at the versions ``npm/package.json`` pins,
    installed (once) from the committed ``package-lock.json`` when one is missing or at another version; after
    an install each must answer ``--version`` (offline) with its pinned version (not checked on every session:
    opencode's 185 MB binary takes seconds to start).

    ``npm install --no-save``, not ``npm ci``: the lock holds opencode's linux-x64 binary packages only (the
    registry this lock was made from serves no other platform's), so ``npm ci`` refuses it as out of sync;
    ``npm install`` installs the locked tree and, with ``--no-save``, leaves both files as they are."""
    pins = json.loads((NPM_DIR / "package.json").read_text())["dependencies"]
    bins = {name: NPM_DIR / "node_modules" / ".bin" / name for name in NPM_CLIS}
    if all(npm_installed_version(pkg) == pins[pkg] and bins[name].exists() for name, pkg in NPM_CLIS.items()):
        return bins
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail(f"npm is needed to install {sorted(NPM_CLIS.values())} for these tests (apt-get install npm)")
    cmd = [npm, "install", "--no-save", "--no-audit", "--no-fund"]
    done = subprocess.run(cmd, cwd=NPM_DIR, capture_output=True, text=True, timeout=scaled(600))
    assert done.returncode == 0, f"{' '.join(cmd)} failed in {NPM_DIR}:\n{done.stdout}\n{done.stderr}"
    for name, pkg in NPM_CLIS.items():
        check = subprocess.run([str(bins[name]), "--version"], capture_output=True, text=True, timeout=scaled(120),
                               env={**os.environ}, stdin=subprocess.DEVNULL)  # fmt: skip
        assert check.returncode == 0 and pins[pkg] in check.stdout, (name, check.stdout, check.stderr)
    return bins


@pytest.fixture(scope="session")
def claude_bin(npm_bins: dict[str, Path]) -> Path:
    """The Claude Code CLI from npm (see ``npm_bins``)."""
    return npm_bins["claude"]


@pytest.fixture(scope="session")
def aider_python() -> Path:
    """A Python that runs aider (``python -m aider``) at the versions ``requirements-aider.txt`` pins, in its own
    venv (aider pins about 100 packages exactly; they must not meet the project's), built once and cached
    under ``$XDG_CACHE_HOME/gyre-jax`` (default ``~/.cache``), keyed by the requirements' hash and this Python."""
    spec = AIDER_REQUIREMENTS.read_bytes() + sys.version.encode()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gyre-jax"
    venv = cache / f"aider-{hashlib.sha256(spec).hexdigest()[:12]}"
    python = venv / "bin" / "python"
    if python.exists():  # built whole (renamed into place when done) from these very requirements
        return python
    building = cache / f"{venv.name}.building-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    # uv (a test dependency) resolves nothing here (the file pins every package) and installs in parallel: seconds,
    # where pip takes minutes for aider's ~100 packages on 2 cores.
    uv = [sys.executable, "-m", "uv"]
    for cmd in ([*uv, "venv", "-q", "--python", sys.executable, str(building)],
                [*uv, "pip", "install", "-q", "--python", str(building / "bin" / "python"), "-r", str(AIDER_REQUIREMENTS)]):  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(900))
        assert done.returncode == 0, (
            f"building aider's venv failed: {cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    [pin] = [
        line.split("==")[1] for line in AIDER_REQUIREMENTS.read_text().splitlines() if line.startswith("aider-chat==")
    ]
    check = subprocess.run([str(building / "bin" / "python"), "-m", "aider", "--version"], capture_output=True, text=True,
                           timeout=scaled(300))  # fmt: skip
    assert check.returncode == 0 and pin in check.stdout, (check.stdout, check.stderr)
    try:
        building.rename(venv)  # atomic: a venv at ``venv`` is always whole (run as ``python -m aider``, so movable)
    except OSError:  # another session built it meanwhile
        shutil.rmtree(building, ignore_errors=True)
    return python
