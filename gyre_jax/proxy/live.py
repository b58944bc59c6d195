"""The live view's routes on the proxy's server: a small read-only page showing what the run's cells are doing now.

``LiveRoutes(snapshot, key)`` mounts on the proxy's app (``ProxyServer(routes=[...])``):

- ``GET /live``: the page (``live.html``, no external resource: it works offline), which polls ``/live/state``
  every second and draws the cells' roles, a Gantt of the current and previous step (role spans, micro-steps,
  optimizer steps, executions), executions by status, the waterlevel, the micro-step queue, the last steps'
  rewards and losses, and links to TensorBoard and the trace;
- ``GET /live/state``: ``snapshot()`` as JSON (``elastic.live.LiveState.snapshot``: the run's published view);
- ``GET /live/trace``: the run's timeline file (Chrome trace JSON; open it in https://ui.perfetto.dev).

Who may read it: clients on this machine's loopback always; any other client only with the run's key ``key``
(``?key=...`` or ``Authorization: Bearer ...``; the proxy binds a non-loopback address only with
``proxy.allow_remote_bind``, and the run then writes the key to ``<workdir>/live_key``); without a key, 403.
The routes only read the published snapshot: a slow or stuck reader never holds anything the run writes.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

from gyre_jax.proxy.server import is_loopback


class LiveRoutes:
    """Mounts the live view (see the module docstring) on an app: ``LiveRoutes(...)(app)``."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], key: str | None = None):
        self.snapshot = snapshot
        self.key = key
        self.page = resources.files("gyre_jax.proxy").joinpath("live.html").read_text(encoding="utf-8")

    def allowed(self, request: Request) -> bool:
        """Loopback clients, or any client sending the run's key."""
        host = request.client.host if request.client is not None else ""
        if host and is_loopback(host):
            return True
        if not self.key:
            return False
        sent = request.query_params.get("key", "")
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            sent = sent or bearer.strip()
        return bool(sent) and hmac.compare_digest(sent.encode(), self.key.encode())

    def _refused(self) -> Response:
        how = "send the run's key (?key=... from <workdir>/live_key)" if self.key else "open it on the run's machine"
        return JSONResponse({"error": {"message": f"the live view is read-only and private to the run: {how}",
                                       "type": "permission_error", "code": "forbidden"}}, status_code=403)  # fmt: skip

    def __call__(self, app: FastAPI) -> None:
        @app.get("/live", include_in_schema=False)
        async def page(request: Request) -> Response:
            if not self.allowed(request):
                return self._refused()
            return HTMLResponse(self.page, headers={"Cache-Control": "no-store"})

        @app.get("/live/state", include_in_schema=False)
        async def state(request: Request) -> Response:
            if not self.allowed(request):
                return self._refused()
            body = json.dumps(_finite(self.snapshot()), separators=(",", ":"))
            return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})

        @app.get("/live/trace", include_in_schema=False)
        async def trace(request: Request) -> Response:
            if not self.allowed(request):
                return self._refused()
            path = self.snapshot().get("links", {}).get("trace")
            if not path or not Path(path).is_file():
                return JSONResponse({"error": {"message": "no timeline written yet", "type": "not_found_error",
                                               "code": "not_found"}}, status_code=404)  # fmt: skip
            return FileResponse(path, media_type="application/json", filename=Path(path).name)


def _finite(x: Any) -> Any:
    """NaN / inf as null (the page's JSON.parse refuses them)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x
