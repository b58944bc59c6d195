"""Default config: a tiny Qwen3-style agent trained with GSPO on CPU with 8 virtual devices.

Run: python -m gyre_jax.train --config configs/tiny_cpu.py [--config.a.b=value ...]
Two cells of 4 devices: each serves rollouts and trains (cell 0, the core, holds the optimizer state);
the scheduling policy (config.schedule.policy) decides when each cell does which.
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.seed = 0
    c.workdir = "runs/tiny_cpu"
    c.total_steps = 40
    c.checkpoint_every = 5  # steps; the last step and an interrupted run always save
    c.keep_checkpoints = 2

    # Devices and meshes. On CPU, num_cpu_devices virtual devices are created before JAX starts.
    c.devices = config_dict.ConfigDict()
    c.devices.platform = "cpu"  # cpu | gpu | tpu
    c.devices.num_cpu_devices = 8
    # Training mesh over all devices (axis sizes multiply to the device count).
    c.mesh = config_dict.ConfigDict()
    c.mesh.data = 4
    c.mesh.fsdp = 2
    c.mesh.tensor = 1
    # Cells: the device list is split into num_cells equal, contiguous cells; each serves with this mesh.
    c.cells = config_dict.ConfigDict()
    c.cells.num_cells = 2
    c.cells.data = 4
    c.cells.fsdp = 1
    c.cells.tensor = 1
    c.cells.sessions_per_cell = 0  # executions a serving cell holds at once (0 = serving.max_concurrent_decodes)
    # Logical axis -> mesh axes (MaxText style). Changing parallelism never touches model code.
    c.sharding_rules = (
        ("batch", ("data", "fsdp")),
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("mlp", "tensor"),
        ("head_dim", None),
    )

    c.model = config_dict.ConfigDict()
    c.model.vocab_size = 272  # byte tokenizer: 256 bytes + 9 special tokens, padded to a multiple of 8
    c.model.num_layers = 2
    c.model.embed_dim = 128
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.mlp_dim = 384
    c.model.rope_theta = 10000.0
    c.model.rms_norm_eps = 1e-6
    c.model.tie_embeddings = True
    c.model.dtype = "float32"  # compute dtype
    c.model.param_dtype = "float32"
    c.model.checkpoint_dir = (
        ""  # a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json); "" = random init
    )

    c.tokenizer = config_dict.ConfigDict()
    c.tokenizer.kind = "byte"
    c.tokenizer.tools_format = "compact"  # tools as one-line signatures: every byte is a token here

    c.serving = config_dict.ConfigDict()
    c.serving.max_concurrent_decodes = 16  # decode slots per cell
    c.serving.max_seq_len = 1024  # KV cache length per slot (prompt + completion)
    c.serving.max_prefill_length = (
        256  # tokens per prefill call: longer prompts are prefilled in chunks between decode steps
    )
    c.serving.prefill_buckets = (128, 256, 512, 1024)
    c.serving.page_size = 16  # tokens per KV page (divides max_seq_len)
    c.serving.kv_pages = 1024  # session prefix cache budget per cell, in pages (0 = no cache); 1024 x 16 = 16K tokens
    c.serving.on_weight_update = (
        "continue"  # in-flight requests: continue on their KV | recompute it under the new weights
    )
    c.serving.reuse_stale_kv = False  # reuse cached KV computed by an older policy version (off: flushed on update)

    c.proxy = config_dict.ConfigDict()
    c.proxy.host = "127.0.0.1"
    c.proxy.port = 0  # 0 picks a free port
    c.proxy.model_name = "gyre-tiny"
    c.proxy.max_request_bytes = 4 * 1024 * 1024

    c.rollout = config_dict.ConfigDict()
    c.rollout.suite = "builtin"
    c.rollout.task_kinds = ("copy", "reverse")
    c.rollout.alphabet = "digits"  # input.txt holds input_min_len..input_max_len random characters
    c.rollout.input_min_len = 2
    c.rollout.input_max_len = 2
    c.rollout.num_tasks = 16  # the suite's fixed training set, visited in seeded epochs (0 = fresh tasks every step)
    c.rollout.tasks_per_step = 2
    c.rollout.timeout_s = 60.0
    c.rollout.max_parallel = 16
    c.rollout.max_turns = 4
    c.rollout.max_tokens_per_call = 128
    c.rollout.temperature = 1.0
    c.rollout.tool_latency_median_s = 0.05
    c.rollout.tool_latency_sigma = 1.0  # lognormal sigma: long-tailed tool times
    c.rollout.evaluator_timeout_s = 30.0

    c.rl = config_dict.ConfigDict()
    c.rl.loss = "gspo"
    c.rl.group_size = 8  # G executions per task
    c.rl.clip_low = 3e-4
    c.rl.clip_high = 4e-4
    c.rl.max_branches = 5  # J_max
    c.rl.micro_batch_size = 8  # sequences per micro-step
    # Objective (docs/learner.md): loss in gspo | gspo_token | grpo (grpo: set clip_low=0.2, clip_high=0.28).
    c.rl.kl_coef = 0.0  # k3 KL to the reference (warm-start) policy; 0 = off, no reference forward pass
    c.rl.recompute_behaviour = False  # False: pi_old = behaviour log-probs recorded by the proxy
    c.rl.behaviour_is_cap = 0.0  # with recompute_behaviour: truncated behaviour importance weight (0 = off)
    c.rl.max_staleness = 4  # eta: executions more policy versions behind are dropped (-1 = no bound)
    c.rl.micro_steps_per_step = 0  # fixed micro-steps per optimizer step; 0 = as many as the step's data needs

    # Trajectory processor (docs/trajectory.md): records -> trees -> J_max branches (rl.max_branches) -> packed rows.
    c.trajectory = config_dict.ConfigDict()
    c.trajectory.packing = (
        "tree"  # tree: shared prefixes computed once (ancestor-only attention) | plain: one branch per sequence
    )
    c.trajectory.row_length = 1024  # tokens per packed row; >= serving.max_seq_len so every branch fits a row
    c.trajectory.tokens_per_micro_batch = 2048  # rows per micro-batch = this / row_length (fixed shape: one compile)
    c.trajectory.max_sequences_per_micro_batch = 64  # sequence slots per micro-batch (GSPO ratios, advantages, weights)
    c.trajectory.open_micro_batches = (
        4  # micro-batches filled at once: more packs tighter, 1 streams each as soon as full
    )
    c.trajectory.stream_order = "task"  # groups enter the pipeline in task order (deterministic) | arrival (sooner)

    c.optimizer = config_dict.ConfigDict()
    c.optimizer.learning_rate = 3e-4
    c.optimizer.warmup_steps = 10
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.99
    c.optimizer.weight_decay = 0.0
    c.optimizer.grad_clip_norm = 1.0
    c.optimizer.schedule = "constant"  # after warmup: constant | cosine | linear decay over decay_steps
    c.optimizer.decay_steps = 0
    c.optimizer.min_lr_ratio = 0.0  # the decayed learning rate ends at learning_rate * min_lr_ratio

    # Supervised warm start on the suite's built-in demonstrations, before RL step 0.
    c.warm_start = config_dict.ConfigDict()
    c.warm_start.steps = 400
    c.warm_start.batch_size = 8
    c.warm_start.learning_rate = 3e-3
    c.warm_start.warmup_steps = 50

    # Evaluation: before the first RL step, after the last, and every `every_steps` (0: only those two).
    # Tasks: the training set when rollout.num_tasks > 0 ("train"), or fresh held-out tasks ("heldout").
    c.eval = config_dict.ConfigDict()
    c.eval.split = "train"
    c.eval.num_tasks = 16  # for the held-out split
    c.eval.samples_per_task = 2
    c.eval.every_steps = 0

    # Scheduling (docs/elastic.md): colocated (all cells serve, then all train) | async (a fixed split; cells
    # 0 .. training_cells-1 train) | elastic (cells leave serving as the rollout waterlevel falls, core first).
    c.schedule = config_dict.ConfigDict()
    c.schedule.policy = "colocated"
    c.schedule.max_staleness = 1  # async/elastic: executions start at most this many policy versions early (eta)
    c.schedule.training_cells = 0  # async: cells that train (0 = half)
    c.schedule.leave_on = (
        "waterlevel"  # elastic: waterlevel (the published rule) | backlog (only with micro-steps waiting)
    )
    c.schedule.idle_before_return_s = 0.0  # elastic: a training cell idle this long may return for ahead executions

    # Multi-process runs (docs/multihost.md): jax.distributed from these keys, or auto-detected (Slurm, TPU).
    c.distributed = config_dict.ConfigDict()
    c.distributed.enabled = False
    c.distributed.coordinator_address = ""  # host:port of process 0 ("" = auto-detect)
    c.distributed.num_processes = 0  # 0 = auto-detect
    c.distributed.process_id = -1  # -1 = auto-detect
    c.distributed.local_device_ids = ()
    c.distributed.initialization_timeout_s = 300.0
    c.distributed.heartbeat_timeout_s = 30.0
    c.distributed.shutdown_timeout_s = 60.0

    c.metrics = config_dict.ConfigDict()
    c.metrics.tensorboard = True
    c.metrics.progress_bar = True
    return c
