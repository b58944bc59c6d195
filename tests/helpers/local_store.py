"""A real control-plane store (``gyre_jax.runtime.kvstore``) on loopback, for tests that run the channels and
remote cells in one process without ``jax.distributed``: the same server and client a multi-process run uses.

Import it from a test module with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from local_store import local_store
"""

from __future__ import annotations

import os

from gyre_jax.runtime import kvstore


def local_store() -> kvstore.StoreClient:
    """A client of a fresh one-process store served on 127.0.0.1 (the server lives while its threads do)."""
    secret = os.urandom(32)
    server = kvstore.StoreServer(kvstore.Store(num_processes=1), secret)
    return kvstore.StoreClient(f"127.0.0.1:{server.port}", secret, process_id=0)
