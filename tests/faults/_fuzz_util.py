"""Shared by tests/faults/test_fuzz.py, test_isolation.py and benchmarks/faults/fuzz.py: a real proxy on a scripted
backend, schemathesis against the proxy's own ``GET /openapi.json``, hypothesis bodies with UTF-8 edge cases,
and the invariants every fuzz run checks (no 5xx, the server still serves, every record parses)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import pathlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Unsatisfiable

from gyre_jax.model.tokenizer import ByteTokenizer
from gyre_jax.proxy.records import RecordStore, TitoRecord
from gyre_jax.proxy.server import ProxyServer
from gyre_jax.serving.scripted import ScriptedBackend

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
    r = httpx.post(live.root + "/v1/chat/completions", json=body, headers=live.headers(execution), timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(live.root + "/health", timeout=30).json() == {"status": "ok"}
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
    for the operation (else ``tally.nonconforming``); a 5xx lands in ``tally.server_errors``."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    document = httpx.get(live.root + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    execution = next(iter(live.keys))
    for result in schema.get_all_operations():
        operation = result.ok()
        documented = set(operation.definition.raw["responses"])
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(live, operation, mode, examples, seed, documented, execution, tally)


def _fuzz_operation(live, operation, mode, examples, seed, documented, execution, tally) -> None:
    import requests
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

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
            response = case.call(base_url=live.root, session=session, headers=headers, timeout=30)
            what = f"{mode.value} {case.method} {case.path} key={bool(headers)} body={str(case.body)[:200]!r}"
            tally.see(what, response.status_code, response.text, response.headers.get("retry-after"))
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
