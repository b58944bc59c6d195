"""Mesh axis names and the named logical-axis rule sets (plain data: the run config imports them without JAX).

Model code names axes (``embed``, ``heads``, ``mlp``, ``vocab``, ``exp``, ``batch`` ...); a rule set says
which mesh axes each one is split over (``model/sharding.py`` applies them).
"""

from __future__ import annotations

from collections.abc import Sequence

Rules = Sequence[tuple[str, "str | Sequence[str] | None"]]
MESH_AXES = ("data", "fsdp", "tensor")  # every mesh has these (size 1 when unused)
EXPERT_AXIS = "expert"  # added when the shape names it: MoE experts split over it (expert parallelism)
ALL_MESH_AXES = MESH_AXES + (EXPERT_AXIS,)
CONTEXT_AXIS = "context"  # added when the shape names it: a row's tokens split over it (model.context_parallel)

# Named rule sets (logical axis -> mesh axes). Configs carry their own ``sharding_rules``; these are
# the reference layouts tests and benchmarks use. Logical axes: batch (activations / decode slots),
# vocab, embed, heads, kv_heads, head_dim, mlp (dense and expert hidden), exp (the expert index).
RULES_DATA: tuple = (("batch", ("data", "fsdp", "tensor", "expert")),)  # pure data parallel: weights replicated
RULES_FSDP_TENSOR: tuple = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("exp", None),
    ("head_dim", None),
)
RULES_EXPERT: tuple = (  # experts over `expert` (tokens are data-parallel over it outside the MoE blocks)
    ("batch", ("data", "fsdp", "expert")),
    ("exp", "expert"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
)
RULE_SETS = {"data": RULES_DATA, "fsdp_tensor": RULES_FSDP_TENSOR, "expert": RULES_EXPERT}
