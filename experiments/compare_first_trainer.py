"""Dumps what a gyre_jax checkout trains on before RL, to compare two code versions on the same seed (docs/results.md,
"Why the default run learned less"): the warm start's demonstrations (token ids and trainable masks of every step),
the training pool, the tasks of RL steps 0-39 and the first held-out tasks.

Usage (each checkout with its own code first on the path; the first trainer is commit dbb34f9):
    git worktree add --detach /tmp/wt-old dbb34f9
    (cd /tmp/wt-old && PYTHONPATH=$PWD python $REPO/experiments/compare_first_trainer.py dump /tmp/old.json)
    PYTHONPATH=$REPO python experiments/compare_first_trainer.py dump /tmp/new.json
    python experiments/compare_first_trainer.py diff /tmp/old.json /tmp/new.json
Only APIs both versions have are used (BuiltinSuite, render_demonstration, the byte tokenizer).
"""

from __future__ import annotations

import json
import sys


def dump(path: str, warm_start_steps: int = 400, batch_size: int = 8, seed: int = 0) -> None:
    from gyre_jax.model.tokenizer import ByteTokenizer
    from gyre_jax.proxy.tito import render_demonstration
    from gyre_jax.rollout.tasks import BuiltinSuite

    tok = ByteTokenizer()
    suite = BuiltinSuite(kinds=("copy", "reverse"), seed=seed, max_turns=4, tool_latency_median_s=0.05,
                         tool_latency_sigma=1.0, alphabet="digits", min_len=2, max_len=2, num_tasks=16)  # fmt: skip
    out = {"demos": [], "pool": [], "steps": [], "heldout": []}
    for i in range(warm_start_steps):  # the warm start's batches, as both trainers draw them (seed * 100_003 + i)
        convs = [
            render_demonstration(tok, m, suite.tools, "compact")
            for m in suite.demonstrations(batch_size, seed * 100_003 + i)
        ]
        out["demos"].append([[list(map(int, c.ids)), list(map(int, c.trainable))] for c in convs])
    task_view = lambda t: [t.task_id, t.kind, t.files, t.expected, t.instruction, t.system]  # noqa: E731
    out["pool"] = [task_view(t) for t in suite.pool()]
    out["steps"] = [[task_view(t) for t in suite.tasks_for_step(s, 2)] for s in range(40)]
    out["heldout"] = [task_view(t) for t in suite.heldout_tasks(16)]
    with open(path, "w") as f:
        json.dump(out, f)


def diff(a_path: str, b_path: str) -> int:
    a, b = json.load(open(a_path)), json.load(open(b_path))
    differ = [k for k in a if a[k] != b.get(k)]
    for k in a:
        print(f"{k:>8}: {'equal' if k not in differ else 'DIFFERENT'} ({len(a[k])} items)")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "diff":
        sys.exit(diff(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
