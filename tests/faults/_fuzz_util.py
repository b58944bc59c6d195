"""Shared by tests/faults/test_fuzz.py, test_isolation.py and benchmarks/faults/fuzz.py: a real proxy on a scripted
backend, schemathesis against the proxy's own ``GET /openapi.json``, hypothesis bodies with UTF-8 edge cases,
and the invariants every fuzz run checks (no 5xx, the server still serves, every record parses)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import pathlib
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.json_input import MAX_JSON_DEPTH
from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.scripted import ScriptedBackend

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:  # a benchmark loads this file by its path
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from timelimits import scaled  # noqa: E402  (tests/timelimits.py: hang guards scaled to the machine's load)

BYTES = ByteTokenizer()
MODEL = "gyre-tiny"
OVERLOAD_STATUSES = (429, 503)  # documented refusals (docs/proxy.md), the only 5xx allowed
POST_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")


@dataclass
class Live:
    """A started proxy: its server, record store, the key of each opened execution, and every log line it wrote."""

    server: ProxyServer
    store: RecordStore
    keys: dict[str, str]
    logs: list[str]

    @property
    def root(self) -> str:
        return self.server.anthropic_base_url

    def headers(self, execution_id: str | None, **extra: str) -> dict[str, str]:
        auth = {} if execution_id is None else {"authorization": f"Bearer {self.keys[execution_id]}"}
        return {**auth, **extra}


class _ListHandler(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def script(prompt: str) -> str:
    """The scripted model: a tool call when the prompt offers tools, else a short answer."""
    if "<tools>" in prompt:
        return '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    return "ok \u00e9\u4e2d"


@contextlib.contextmanager
def live_proxy(tmp: pathlib.Path, executions: tuple[str, ...] = ("e0",), **kwargs) -> Iterator[Live]:
    """A ProxyServer on a ScriptedBackend with ``executions`` opened; every log record of every logger captured."""
    logs: list[str] = []
    handler = _ListHandler(logs)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    store = RecordStore(tmp / "records")
    backend = ScriptedBackend(BYTES, script)
    try:
        with ProxyServer(backend, BYTES, store, model_name=MODEL, max_request_bytes=256 * 1024, **kwargs) as server:
            keys = {e: server.open_execution(e) for e in executions}
            yield Live(server, store, keys, logs)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


@dataclass
class Tally:
    """What a fuzz run saw: calls per status, the 5xx (with what caused them), responses off the schema."""

    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    nonconforming: list[str] = field(default_factory=list)
    cases: int = 0

    def see(self, what: str, status: int, text: str, retry_after: str | None = None) -> None:
        self.statuses[status] += 1
        refusal = status in OVERLOAD_STATUSES and retry_after is not None
        if status >= 500 and not refusal:
            self.server_errors.append(f"{status} for {what}: {text[:300]}")

    @property
    def five_xx(self) -> int:
        return len(self.server_errors)


def check_alive_and_records(live: Live) -> int:
    """Asserts the server still answers a valid call and every record file parses line by line (no torn or
    corrupted line) as ``TitoRecord``s; returns the number of records."""
    execution = next(iter(live.keys))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "still there?"}]}
    r = httpx.post(live.root + "/v1/chat/completions", json=body, headers=live.headers(execution), timeout=scaled(30))
    assert r.status_code == 200, r.text
    assert httpx.get(live.root + "/health", timeout=scaled(30)).json() == {"status": "ok"}
    count = 0
    for path in sorted(live.store.root.glob("*.jsonl")):
        data = path.read_bytes()
        assert data.endswith(b"\n") or not data, f"{path} ends with a torn line"
        for line in data.decode("utf-8").splitlines():
            record = TitoRecord.from_json(line)  # raises on a corrupted line
            json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"{c} in a record")))
            assert all(math.isfinite(x) for x in record.completion_logprobs)
            count += 1
    return count


# -- schemathesis ------------------------------------------------------------------------------------------------


def schemathesis_fuzz(live: Live, examples: int, seed: int, tally: Tally) -> None:
    """schemathesis against the proxy's own ``GET /openapi.json``: for every operation, ``examples`` positive and
    ``examples`` negative cases, each sent with the execution's key and without one. Statuses must be documented
    for the operation and a keyed operation must answer 401 without the key (else ``tally.nonconforming``); a 5xx
    lands in ``tally.server_errors``."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    document = httpx.get(live.root + "/openapi.json", timeout=scaled(30)).json()
    schema = schemathesis.openapi.from_dict(document)
    execution = next(iter(live.keys))
    for result in schema.get_all_operations():
        operation = result.ok()
        documented = set(operation.definition.raw["responses"])
        keyed = bool(operation.definition.raw.get("security"))
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(live, operation, mode, examples, seed, (documented, keyed), execution, tally)


def _fuzz_operation(live, operation, mode, examples, seed, expected, execution, tally) -> None:
    """One operation's cases in one mode; ``expected`` is (its documented statuses, whether it needs the key)."""
    import requests
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    documented, keyed = expected
    CONFORMANCE_CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]

    session = requests.Session()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        tally.cases += 1
        for headers in (live.headers(execution), {}):
            case.headers = {
                k: v for k, v in (case.headers or {}).items() if k.lower() not in ("authorization", "x-api-key")
            }
            response = case.call(base_url=live.root, session=session, headers=headers, timeout=scaled(30))
            what = f"{mode.value} {case.method} {case.path} key={bool(headers)} body={str(case.body)[:200]!r}"
            tally.see(what, response.status_code, response.text, response.headers.get("retry-after"))
            if keyed and not headers and response.status_code != 401:
                tally.nonconforming.append(f"{response.status_code} without a key for {what}")
            if str(response.status_code) not in documented:
                tally.nonconforming.append(f"undocumented {response.status_code} for {what}")
            try:  # schemathesis' own checks: status and content type documented, body matches the response schema
                case.validate_response(response, checks=CONFORMANCE_CHECKS)
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - a failed check, counted (its text says which)
                tally.nonconforming.append(f"{type(exc).__name__} for {what}: {str(exc)[:300]}")

    try:
        hypothesis_seed(seed)(run)()
    except Unsatisfiable:  # nothing to negate (GET /health has no input): no negative case exists
        pass


# -- hand-made hostile bodies and hypothesis-generated ones --------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
HOSTILE = {  # name -> (body bytes, status)
    "100000 nested arrays": (DEEP, 400),
    "nesting past the limit": (b'{"model": "gyre-tiny", "x": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", 400),
    "lone high surrogate": (b'{"model": "gyre-tiny", "messages": [{"role": "user", "content": "a\\ud800b"}], "prompt": "\\ud800"}', 400),
    "lone low surrogate in a key": (b'{"model": "gyre-tiny", "\\udc00": 1, "messages": [{"role": "user", "content": "a"}]}', 400),
    "NaN": (b'{"model": "gyre-tiny", "temperature": NaN, "messages": [{"role": "user", "content": "a"}]}', 400),
    "Infinity in a tool schema": (b'{"model": "gyre-tiny", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": -Infinity}}}], "messages": [{"role": "user", "content": "a"}]}', 400),
    "an int of 5000 digits": (b'{"model": "gyre-tiny", "seed": 1' + b"0" * 5000 + b', "messages": [{"role": "user", "content": "a"}]}', 400),
    "invalid UTF-8": (b'{"model": "gyre-tiny", "messages": [{"role": "user", "content": "\xff\xfe\xc3("}]}', 400),
    "not an object": (b"[1, 2]", 400),
    "over the body limit": (b'{"model": "gyre-tiny", "x": "' + b"a" * 300_000 + b'"}', 413),
}  # fmt: skip


def send_hostile(live: Live, tally: Tally) -> int:
    """Every ``HOSTILE`` body to every POST route with the key; an answer other than its 4xx is nonconforming."""
    sent = 0
    with httpx.Client(timeout=scaled(60)) as client:
        for name, (body, status) in HOSTILE.items():
            for path in POST_PATHS:
                r = client.post(live.root + path, content=body, headers=live.headers(next(iter(live.keys))))
                sent += 1
                tally.see(f"{name} to {path}", r.status_code, r.text)
                if r.status_code != status:
                    tally.nonconforming.append(f"{name} to {path}: {r.status_code} (expected {status}) {r.text[:200]}")
    return sent


EDGE_TEXT = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["\ud800", "\udfff", "a\udc00b", "\x00", "\U0010ffff", "\u2028", "<|im_end|>", "<tool_call>", ""]),
)
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | EDGE_TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(EDGE_TEXT, children, max_size=4),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", 5])},
    optional={"content": st.one_of(EDGE_TEXT, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image",
              "tool_use", "tool_result", "thinking"])}, optional={"text": EDGE_TEXT, "id": EDGE_TEXT, "input": JSON_VALUE,
              "content": EDGE_TEXT, "tool_use_id": EDGE_TEXT}), max_size=3), JSON_VALUE),
              "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
                  {"name": EDGE_TEXT, "arguments": st.one_of(EDGE_TEXT, JSON_VALUE)})}), max_size=2),
              "tool_call_id": EDGE_TEXT, "name": EDGE_TEXT},
)  # fmt: skip
TOOL = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": EDGE_TEXT}, optional={"parameters": JSON_VALUE, "description": EDGE_TEXT})}),
    st.fixed_dictionaries({"name": EDGE_TEXT}, optional={"input_schema": JSON_VALUE, "type": EDGE_TEXT}),
    JSON_VALUE,
)  # fmt: skip


BODY = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=4), "path": st.sampled_from(POST_PATHS), "stream": st.booleans()},
    optional={"tools": st.lists(TOOL, max_size=2)},
)


def generated_body(drawn: dict) -> tuple[str, bytes]:
    """(path, JSON bytes) of a drawn ``BODY``: the same messages under each API's field names; ``ensure_ascii`` sends
    lone surrogates as ``\\ud800`` escapes, as a client with a broken string would."""
    messages = drawn["messages"]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": drawn["stream"], "input": messages,
            "prompt": messages[0].get("content", "x") if messages else "x"}  # fmt: skip
    if "tools" in drawn:
        body["tools"] = drawn["tools"]
    return drawn["path"], json.dumps(body).encode()


def hypothesis_fuzz(live: Live, examples: int, seed: int, tally: Tally) -> None:
    """``examples`` generated bodies (``BODY``), seeded, each to its route with the key; statuses into ``tally``."""
    client = httpx.Client(timeout=scaled(60))

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(drawn=BODY)
    def run(drawn) -> None:
        tally.cases += 1
        path, data = generated_body(drawn)
        r = client.post(live.root + path, content=data, headers=live.headers(next(iter(live.keys))))
        tally.see(f"generated {path} {data[:200]!r}", r.status_code, r.text)

    with client:
        hypothesis_seed(seed)(run)()
