"""Serving: the JetStream-style engine (``engine``), sampling, the continuous-batching loop of a cell
(``loop``), the session prefix cache index (``prefix_cache``), stop strings (``stopping``), migratable
session state (``session``) and the request/result records (``types``). See docs/serving.md."""
