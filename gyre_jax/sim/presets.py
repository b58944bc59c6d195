"""Simulator presets: workloads shaped from published statistics, on clusters of thousands of accelerators.

Each preset is an ml_collections ``ConfigDict`` (``configs/sim_<name>.py`` returns it, so every number
can be overridden from the command line: ``--config.workload.timeout_s=5400``). Sources, and what is
assumed where no source gives a number:

Published system (the two seed articles in ``/work/shared/seeds``, describing QwenGyre):
- Qwen3.6 122B on NL2RepoBench, DeepSWE and TerminalBench; Qwen3.8 2.4T-A95B on NL2RepoBench with
  rollouts of about 700K tokens, 48 steps; many rollouts ran close to their timeout; Claude Code as the
  harness; GSPO with 16 rollouts per group; matched accelerator budget and staleness.
- Role switch 8.52 s serving -> training and 3.46 s back (2.4T, RDMA): used for every preset
  (an assumption for the 122B model, whose weights are 20x smaller: conservative).
- J_max = 5.
Public benchmark descriptions:
- DeepSWE (Agentica / R2E-Gym): at most 100 steps per trajectory, mean about 64 turns, contexts up to
  about 130K tokens (the brief's statistics); tests run in containers.
- Terminal-Bench: terminal tasks in containers with per-task agent timeouts of minutes to an hour; the
  number of commands and their run time vary widely (compiles, installs, short shell commands).
- NL2RepoBench: a repository generated from a natural-language specification, scored by the
  repository's test suite; hundreds of tool calls and several context compactions per run.
Assumed (no public number): the 122B model's shape (an MoE, 10B active, 64 layers, 4 KV heads of 128,
full attention everywhere, FP8 serving weights), the 2.4T model's shape (95B active, 96 layers, 8 KV
heads, attention width 12288), H800-class accelerators (989 TFLOP/s BF16 dense, 3.35 TB/s, 80 GB),
efficiencies (decode 50% of HBM bandwidth, prefill 40% and training 25% of peak FLOPs), per-call token
counts, tool-time and evaluator-time distributions, timeouts, and the sub-agent share of tokens. The
batch is 64 tasks x 16 rollouts = 1024 executions per step, and engines are sized so that all cells
serving hold exactly one batch (the cluster is sized for the batch, as a colocated run would be).

LoRA (``--config.cost.lora_rank=R``): the roofline cost model then moves the adapter instead of the weights in
switches and weight syncs (``cost_model.with_lora``); the core needs only a frozen BF16 base plus the adapter's
training state (``cost_model.core_accelerators``), so smaller cells can hold it (set ``cluster.cell_accelerators``
and ``cost.min_cell_accelerators`` to match; docs/simulator.md, "LoRA").

Cells over hosts: 8 accelerators per host, 8 x 400 Gb/s InfiniBand per host (400 GB/s) at 70%; weight syncs,
gradients to the core and KV moves take the bytes they move over the hosts of the cells they join
(``cost_model.interhost_costs``, docs/simulator.md).

Cells: a cell must hold a training replica. The core keeps BF16 weights, FP32 master weights, gradients
and Adam moments: about 16-18 bytes per parameter, so 122B needs >= 25 accelerators of 80 GB (cells of
32, i.e. 4 nodes of 8) and 2.4T needs >= 480 (cells of 512).
"""

from __future__ import annotations

from ml_collections import config_dict

H800 = dict(name="H800-class", flops=989e12, hbm_bandwidth=3.35e12, memory_bytes=80e9)
QWEN_122B = dict(
    total_params=122e9,
    active_params=10e9,
    layers=64,
    kv_heads=4,
    head_dim=128,
    attention_dim=4096,
    serving_bytes_per_param=1.0,
    kv_bytes_per_element=2.0,
    embed_dim=4096,  # assumed, as the rest of this shape; only a LoRA adapter's size reads these three
    num_experts=256,
    expert_mlp_dim=576,
)
QWEN_30B = dict(
    total_params=30e9,
    active_params=3e9,
    layers=48,
    kv_heads=4,
    head_dim=128,
    attention_dim=4096,
    serving_bytes_per_param=1.0,
    kv_bytes_per_element=2.0,
    embed_dim=2048,  # Qwen3-30B-A3B's config.json
    num_experts=128,
    expert_mlp_dim=768,
)
QWEN_2400B = dict(
    total_params=2.4e12,
    active_params=95e9,
    layers=96,
    kv_heads=8,
    head_dim=128,
    attention_dim=12288,
    serving_bytes_per_param=1.0,
    kv_bytes_per_element=2.0,
    embed_dim=12288,  # assumed: with 512 experts of 1280, 96 layers give ~2.4T parameters
    num_experts=512,
    expert_mlp_dim=1280,
)


def _dist(median: float, sigma: float = 0.0, lo: float = 0.0, hi: float = float("inf")) -> config_dict.ConfigDict:
    return config_dict.ConfigDict(dict(median=float(median), sigma=float(sigma), lo=float(lo), hi=float(hi)))


def base(name: str, description: str) -> config_dict.ConfigDict:
    """What every preset shares: the run shape, the schedule, 122B on 1024 H800-class accelerators."""
    c = config_dict.ConfigDict()
    c.name = name
    c.description = description
    c.seed = 0
    c.steps = 48
    c.tasks_per_step = 64
    c.group_size = 16  # GSPO rollouts per task (published)
    c.max_branches = 5  # J_max (published); 0 = uncapped
    c.segments = 8  # segments per execution: the serving model's time resolution
    # cells of 32 = 4 hosts of 8; cell-to-cell moves (weight syncs, gradients to the core, KV) cross the hosts'
    # network: 8 x 400 Gb/s InfiniBand per host (400 GB/s) at 70% (cost_model.interhost_costs; 0 = use the
    # cost's weight_sync_s and kv_migration_s_per_token as given)
    c.cluster = config_dict.ConfigDict(dict(accelerators=1024, cell_accelerators=32, accelerators_per_host=8,
                                            host_bandwidth=400e9, link_efficiency=0.7))  # fmt: skip
    c.schedule = config_dict.ConfigDict(
        dict(
            policy="elastic",  # colocated | async | elastic
            dispatch_staleness=1,  # eta, for async and elastic (colocated is on-policy); as the run config's
            training_cells=0,  # async only: cells in the training pool (0 = half of them)
            streaming=True,  # micro-steps claimable as executions are evaluated
            stream_unit="execution",  # execution | group (a task's G executions at once) | group_in_order
            # partial rollouts: a step trains the first tasks_per_step groups to complete; groups still running
            # carry on across the weight update into a later step (needs stream_unit="group")
            partial_rollouts=False,
            drop_staleness=-1,  # partial rollouts: drop executions whose oldest token is more versions behind
            admission="task",  # task | longest_first (tasks predicted longest by their history first; task_pool > 0)
            # a group trains once this many of its G members ended; the others are aborted (0: the whole group)
            group_quorum=0,
        )
    )
    c.model = config_dict.ConfigDict(dict(QWEN_122B))
    c.hardware = config_dict.ConfigDict(dict(H800))
    c.cost = config_dict.ConfigDict(
        dict(
            replica_accelerators=8,  # FP8 122B (122 GB) on one node per serving engine
            slots_per_replica=8,  # 128 replicas x 8 = 1024 sessions: one batch when every cell serves
            min_cell_accelerators=32,
            reference_cell_accelerators=32,
            train_mfu=0.25,
            decode_mbu=0.5,
            prefill_mfu=0.4,
            decode_overhead_s=0.005,
            scaling_exponent=0.95,
            micro_step_tokens=262_144,
            micro_step_overhead_s=0.5,
            optimizer_step_s=5.0,
            grad_reduce_s=2.0,
            serving_to_training_s=8.52,
            training_to_serving_s=3.46,  # published (2.4T over RDMA)
            # a weight sync's fixed part (pause and hand-over); moving the bytes is added from the interconnect
            weight_sync_s=0.5,
            kv_migration_s_per_token=3.3e-7,  # used only without an interconnect (cluster.host_bandwidth = 0)
            processing_s_per_token=2e-6,
            pipeline_workers=32,
            # LoRA (cost_model.with_lora): rank 0 = full fine-tuning. lora_targets: "attention" and/or "experts",
            # comma-separated; switch_weight_share: the share of each switch / weight sync that is weight movement
            # (assumed: the published switch times do not break down), which then moves the adapter instead.
            lora_rank=0,
            lora_targets="attention",
            switch_weight_share=0.9,
        )
    )
    c.cost_model_file = ""  # a cost model JSON (e.g. measured by a real run) replaces the roofline numbers
    return c


def deepswe() -> config_dict.ConfigDict:
    c = base("deepswe", "SWE tasks (DeepSWE-like): mean ~64 turns, at most 100, contexts up to ~130K tokens")
    w = c.workload = config_dict.ConfigDict()
    w.turns = _dist(60, 0.35, 8, 100)  # mean ~64 with the per-task factor; DeepSWE caps at 100 steps
    w.task_sigma = 0.25
    w.gen_tokens = _dist(450, 0.6, 20, 8000)  # reasoning + one tool call per turn (assumed)
    w.obs_tokens = _dist(900, 1.0, 20, 16000)  # file views, test output: 64 turns reach ~100-130K
    w.initial_context = 6000
    w.tool_s = _dist(4.0, 1.2, 0.1, 900)  # shell commands in a container; test runs take minutes
    w.setup_s = _dist(30, 0.5, 5, 300)  # container start
    w.eval_s = _dist(60, 0.6, 5, 900)  # the task's tests on the final workspace
    w.timeout_s = 3600.0
    w.context_window = 131072  # compaction past ~128K (rare at 100 turns)
    w.summary_tokens = 8000
    w.subagent_fraction = 0.0  # a single agent thread
    w.subagent_tokens = 1.0
    w.task_pool = 0  # tasks in the dataset (0: each step's tasks are new; >0: tasks recur, history predicts)
    return c


def terminal() -> config_dict.ConfigDict:
    c = base("terminal", "terminal tasks (TerminalBench-like): few to hundreds of commands, widely varying run time")
    w = c.workload = config_dict.ConfigDict()
    w.turns = _dist(25, 0.9, 3, 250)  # long tail: most tasks take tens of commands, some hundreds
    w.task_sigma = 0.5  # task difficulty varies a lot across Terminal-Bench tasks
    w.gen_tokens = _dist(350, 0.7, 20, 8000)
    w.obs_tokens = _dist(500, 1.2, 10, 16000)  # terminal output
    w.initial_context = 5000
    w.tool_s = _dist(3.0, 1.6, 0.05, 1200)  # from `ls` to a compile or a test suite
    w.setup_s = _dist(20, 0.5, 5, 300)
    w.eval_s = _dist(30, 0.6, 5, 600)
    w.timeout_s = 2700.0  # per-task agent limits range from minutes to an hour
    w.context_window = 131072
    w.summary_tokens = 8000
    w.subagent_fraction = 0.0
    w.subagent_tokens = 1.0
    w.task_pool = 0  # tasks in the dataset (0: each step's tasks are new; >0: tasks recur, history predicts)
    return c


def nl2repo() -> config_dict.ConfigDict:
    c = base(
        "nl2repo", "repository generation (NL2Repo-like), Qwen3.6 122B: hundreds of calls, compactions, sub-agents"
    )
    w = c.workload = config_dict.ConfigDict()
    w.turns = _dist(140, 0.45, 30, 500)
    w.task_sigma = 0.3
    w.gen_tokens = _dist(500, 0.7, 20, 12000)  # writes whole files
    w.obs_tokens = _dist(1000, 1.0, 10, 20000)
    w.initial_context = 12000  # Claude Code's system prompt and tools
    w.tool_s = _dist(5.0, 1.2, 0.1, 1200)  # installs, builds, test runs
    w.setup_s = _dist(30, 0.5, 5, 300)
    w.eval_s = _dist(120, 0.5, 10, 1200)  # the repository's test suite
    w.timeout_s = 7200.0
    w.context_window = 160000  # Claude Code compacts near its window
    w.summary_tokens = 12000
    w.subagent_fraction = 0.3  # Task-tool sub-agents explore and implement modules (assumed)
    w.subagent_tokens = 40000
    w.task_pool = 0  # tasks in the dataset (0: each step's tasks are new; >0: tasks recur, history predicts)
    return c


def flagship() -> config_dict.ConfigDict:
    c = nl2repo()
    c.name = "flagship"
    c.description = (
        "the flagship case: NL2Repo on Qwen3.8 2.4T-A95B, ~700K tokens per rollout, durations clustered at the timeout"
    )
    c.model = config_dict.ConfigDict(dict(QWEN_2400B))
    c.cluster.accelerators = 4096
    c.cluster.cell_accelerators = 512  # the core's optimizer state needs ~480 accelerators
    c.cost.replica_accelerators = 64  # FP8 2.4T (2.4 TB) per serving engine
    c.cost.slots_per_replica = 16  # 64 replicas x 16 = 1024 sessions: one batch when every cell serves
    c.cost.min_cell_accelerators = 512
    c.cost.reference_cell_accelerators = 512
    c.cost.micro_step_tokens = 1_048_576
    c.cost.optimizer_step_s = 20.0
    c.cost.grad_reduce_s = 5.0
    w = c.workload
    w.turns = _dist(300, 0.35, 80, 900)  # ~2500 tokens per call: ~700K tokens in a run that is not cut short
    w.task_sigma = 0.25
    w.gen_tokens = _dist(380, 0.6, 20, 12000)
    w.obs_tokens = _dist(1300, 1.0, 10, 20000)
    w.context_window = 262144
    w.summary_tokens = 16000
    w.timeout_s = 7200.0  # slow decode of a 2.4T model: about two thirds of the rollouts run into it
    return c


def tiny() -> config_dict.ConfigDict:
    """A small cluster for tests, notebooks and CI: 8 cells of 8 accelerators, 4 x 8 executions per step."""
    c = deepswe()
    c.name = "tiny"
    c.description = "a small SWE-like run for tests and notebooks"
    c.steps = 4
    c.tasks_per_step = 4
    c.group_size = 8
    c.model = config_dict.ConfigDict(dict(QWEN_30B))  # a model whose training replica fits 8 accelerators
    c.cluster.accelerators = 64
    c.cluster.cell_accelerators = 8
    c.cost.replica_accelerators = 2
    c.cost.min_cell_accelerators = 8
    c.cost.reference_cell_accelerators = 8
    c.cost.slots_per_replica = 1  # 32 replicas x 1 = 32 sessions: one batch
    c.workload.turns = _dist(12, 0.5, 2, 40)
    c.workload.timeout_s = 1800.0
    return c


PRESETS = {"deepswe": deepswe, "terminal": terminal, "nl2repo": nl2repo, "flagship": flagship, "tiny": tiny}
