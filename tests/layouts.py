"""Device layouts the tests run under, in one place.

The default config (the tiny run users start with) has 2 virtual CPU devices in 2 cells of 1 device; tests that
exercise multi-device cells (sharded serving and training, KV moving between cells of several devices, processes
holding several devices each) run under ``EIGHT_DEVICES``: 8 virtual devices, a data=4 x fsdp=2 training mesh and
2 cells of 4. tests/conftest.py puts this directory on ``sys.path``, so every test module imports it as ``layouts``.
"""

EIGHT_DEVICES_OVERRIDES = {"devices.num_cpu_devices": 8, "mesh.data": 4, "mesh.fsdp": 2, "cells.data": 4}
EIGHT_DEVICES = [f"--config.{key}={value}" for key, value in EIGHT_DEVICES_OVERRIDES.items()]
