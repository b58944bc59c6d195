"""Checks a real-model run's records against what the harness saw and what the learner trained (issue 42, item 1).

    python experiments/check_smol_records.py RUN_DIR [--json OUT]

For every execution of a ``configs/smollm2_cpu.py`` run (or any GGUF-tokenizer run through mini-swe-agent):

- **template**: each call's recorded prompt, decoded, is the checkpoint's own chat template rendered over a prefix
  of the messages mini-swe-agent kept (its ``trajectory.json``), rendered here independently of the proxy (jinja2's
  sandbox with transformers' ``apply_chat_template`` settings over the template text read from the GGUF metadata
  with ``gguf``); and each call's completion, decoded without its end-of-turn token, is the next assistant
  message mini kept (when it kept one: mini drops a reply that fails its format check);
- **ids**: a call that continues an earlier one (``reused_prefix_len > 0``; the previous call, or an earlier one
  when mini dropped a reply that failed its format check) starts with exactly the ids the model produced (that
  call's prompt + completion ids), not a re-tokenization of their text (a reply cut at max_tokens is followed by
  the template's end-of-turn id, which the proxy counts in ``reused_prefix_len``);
- **masks**: the step's micro-batches, rebuilt by the run's own trajectory pipeline from its queue and records,
  train only policy tokens: every position with a non-zero loss weight, read through its tree-attention context
  (the tokens it attends to), is ``prompt_ids + completion_ids[:k]`` of a recorded call followed by that call's
  completion token ``k`` with its recorded log-prob; and every completion token of a selected branch is trained.

Exit status 1 with one line per violation, 0 if clean; the counts go to stdout (and ``--json``). The model side
(the ids are those the model sampled, at the recorded log-probs) is the learner's ``logprob_gap`` in
``metrics.jsonl`` (mean |log pi_train - log pi_behaviour| over trained tokens), which this prints per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _gguf_template_and_tokenizer(config):
    import gguf

    from gyre_jax.model.checkpoints import resolve_checkpoint
    from gyre_jax.model.tokenizer import load_tokenizer

    path = str(resolve_checkpoint(config.tokenizer.path or config.model.checkpoint_dir))
    reader = gguf.GGUFReader(path)
    field = reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    return template, load_tokenizer("gguf", path, config.tokenizer.gguf_pre)


def _render(template: str):
    """transformers' ``apply_chat_template`` environment (chat_template_utils._compile_jinja_template)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    return lambda messages: compiled.render(messages=messages, add_generation_prompt=True)


def _reuses(call: dict, earlier: dict) -> bool:
    """Whether ``call``'s first ``reused_prefix_len`` prompt ids are ``earlier``'s prompt + completion ids (past
    them: at most the end-of-turn id that a reply cut at max_tokens lacked), covering ``earlier``'s prompt."""
    before = earlier["prompt_ids"] + earlier["completion_ids"]
    n = min(call["reused_prefix_len"], len(before))
    return (
        n >= len(earlier["prompt_ids"])
        and call["reused_prefix_len"] <= len(before) + 1
        and call["prompt_ids"][:n] == before[:n]
    )


def check_template_and_ids(run: Path, config, problems: list[str]) -> dict:
    template, tok = _gguf_template_and_tokenizer(config)
    render = _render(template)
    eos = set(tok.eos_ids)
    counts = {"executions": 0, "calls": 0, "prompts_rendered_equal": 0, "completions_equal": 0,
              "completions_dropped_by_harness": 0, "continuations": 0, "continuations_exact": 0,
              "executions_without_trajectory": 0, "calls_with_trajectory": 0}  # fmt: skip
    for rec_path in sorted((run / "records").glob("*.jsonl")):
        eid = rec_path.stem
        traj = run / "executions" / eid / "harness" / "trajectory.json"
        calls = [json.loads(line) for line in rec_path.read_text().splitlines() if line.strip()]
        counts["executions"] += 1
        counts["calls"] += len(calls)
        for idx, c in enumerate(calls):
            if c["reused_prefix_len"] > 0:
                counts["continuations"] += 1
                if any(_reuses(c, e) for e in calls[:idx]):
                    counts["continuations_exact"] += 1
                else:
                    problems.append(f"{eid} call {c['call_index']}: its reused prefix is no earlier call's ids")
        if not traj.is_file():
            counts["executions_without_trajectory"] += 1  # killed before mini wrote it
            continue
        messages = [
            {"role": m["role"], "content": m["content"] or ""} for m in json.loads(traj.read_text())["messages"]
        ]
        counts["calls_with_trajectory"] += len(calls)
        renders = {
            i: render(messages[:i]) for i in range(1, len(messages) + 1) if messages[i - 1]["role"] != "assistant"
        }
        for c in calls:
            text = tok.decode(c["prompt_ids"])
            match = [i for i, r in renders.items() if r == text]
            if not match:
                problems.append(f"{eid} call {c['call_index']}: the recorded prompt is no rendering of mini's messages")
                continue
            counts["prompts_rendered_equal"] += 1
            i = match[-1]
            ids = c["completion_ids"]
            ids = ids[:-1] if ids and ids[-1] in eos else ids
            if i < len(messages) and messages[i]["role"] == "assistant":
                if tok.decode(ids) == messages[i]["content"]:
                    counts["completions_equal"] += 1
                else:
                    problems.append(
                        f"{eid} call {c['call_index']}: the completion is not the assistant message mini kept"
                    )
            else:
                counts["completions_dropped_by_harness"] += 1
    return counts


def _contexts(mb, row: int) -> list[tuple[int, list[int]]]:
    """(position, the tokens position ``i`` attends to, in order) for every trained position of ``row``."""
    seg, end, tokens = mb.segment_ids[row], mb.subtree_end[row], mb.tokens[row]
    out = []
    for i in np.flatnonzero(mb.loss_mask[row] > 0):
        j = np.arange(i + 1)
        seen = j[(seg[j] == seg[i]) & (end[j] > i)]
        out.append((int(i), [int(t) for t in tokens[seen]]))
    return out


def check_masks(run: Path, config, problems: list[str]) -> dict:
    from gyre_jax.trajectory.pipeline import TrajectoryPipeline

    tcfg = dataclasses.replace(config.trajectory_config(), vocab_size=_vocab(config))
    counts = {"steps": 0, "micro_batches": 0, "trained_positions": 0, "trained_positions_policy": 0,
              "completion_tokens_selected": 0}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:  # the pipeline truncates and reads its queue: work on a copy
        shutil.copy(run / "trajectory" / "queue.jsonl", Path(tmp) / "queue.jsonl")
        pipe = TrajectoryPipeline(run / "records", tmp, tcfg, discard_unsaved=False)
        calls = {}
        for path in (run / "records").glob("*.jsonl"):
            calls[path.stem] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        while True:
            try:
                batches = pipe.next_step()
            except Exception:  # noqa: BLE001 - no whole step left in the queue
                break
            counts["steps"] += 1
            trained_keys = set()
            for mb, seqs in zip(batches.micro_batches, batches.sequences):
                counts["micro_batches"] += 1
                for row in range(mb.tokens.shape[0]):
                    for i, ctx in _contexts(mb, row):
                        counts["trained_positions"] += 1
                        eid = seqs[int(mb.seq_index[row, i])].execution_id
                        target, old = int(mb.targets[row, i]), float(mb.old_logprobs[row, i])
                        ok = False
                        for c in calls[eid]:
                            p, comp = c["prompt_ids"], c["completion_ids"]
                            k = len(ctx) - len(p)
                            if 0 <= k < len(comp) and comp[k] == target and ctx == p + comp[:k]:
                                if abs(c["completion_logprobs"][k] - old) < 1e-6:
                                    ok = True
                                    trained_keys.add((eid, tuple(ctx), target))
                                    break
                        if ok:
                            counts["trained_positions_policy"] += 1
                        else:
                            problems.append(f"step {batches.step}: {eid} row {row} position {i} trains a token that "
                                            "is no recorded completion token in its recorded context")  # fmt: skip
            for eid in batches.executions:  # every completion token of the executions trained is trained once
                want = {(eid, tuple(c["prompt_ids"] + c["completion_ids"][:k]), t)
                        for c in calls[eid] for k, t in enumerate(c["completion_ids"])}  # fmt: skip
                counts["completion_tokens_selected"] += len(want)
                missing = want - trained_keys
                if missing and tcfg.max_branches >= len(calls[eid]):
                    problems.append(f"step {batches.step}: {eid}: {len(missing)} completion tokens are not trained")
    return counts


def _vocab(config) -> int:
    from gyre_jax.model.checkpoints import Checkpoint, resolve_checkpoint

    with Checkpoint(str(resolve_checkpoint(config.model.checkpoint_dir))) as ckpt:
        return ckpt.model_config().vocab_size


def logprob_gaps(run: Path) -> list[tuple[int, float]]:
    out, path = [], run / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        m = json.loads(line)
        if m.get("phase") == "train" and m.get("logprob_gap") is not None:
            out.append((int(m["step"]), float(m["logprob_gap"])))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from gyre_jax.config import RunConfig

    config = RunConfig.from_config_dict(json.loads((args.run / "config.json").read_text()))
    problems: list[str] = []
    out = {"template_and_ids": check_template_and_ids(args.run, config, problems),
           "masks": check_masks(args.run, config, problems), "logprob_gap": logprob_gaps(args.run)}  # fmt: skip
    out["problems"] = problems
    print(json.dumps({k: v for k, v in out.items() if k != "problems"}, indent=1))
    for p in problems:
        print(p)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print("clean" if not problems else f"{len(problems)} violations")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
