"""Entry point: ``python -m gyre_jax.train [--config configs/<name>.py] [--config.a.b=value ...]``.

Loads and validates the config before any work starts (a bad config exits with status 2 and one
line saying what is wrong), creates the devices the config asks for, then runs the ``Trainer``.
Running again with the same ``workdir`` resumes from the last checkpoint; SIGINT/SIGTERM save and exit.

Multi-process (one process per host, ``config.distributed``; docs/multihost.md): run the same command on
every host. Process 0 leads (it prints the step lines); the others run their cells and exit with it. A
lost or failed process stops all of them (exit code 75 on the survivors): rerun all to resume.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from gyre_jax import config as config_lib


def configure_devices(config) -> None:
    """Selects the platform and, on CPU, creates ``num_cpu_devices`` virtual devices (before JAX starts)."""
    platform = config.devices.platform
    if platform == "cpu":
        flag = f"--xla_force_host_platform_device_count={config.devices.num_cpu_devices}"
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import jax

    jax.config.update("jax_platforms", platform)
    if platform == "cpu":
        jax.config.update("jax_num_cpu_devices", config.devices.num_cpu_devices)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    try:
        config = config_lib.load_config(argv)
    except config_lib.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("absl", "jax._src", "orbax", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    multi = config.distributed.enabled
    if multi:  # joins the run (jax.distributed); a lost or failed peer stops every process (docs/multihost.md)
        from gyre_jax import distributed

        try:
            distributed.initialize(config)
        except distributed.DistributedError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        configure_devices(config)

    from gyre_jax.trainer import Trainer

    trainer = Trainer(config)
    try:
        step = trainer.run()
    finally:
        trainer.close()
    if trainer.is_leader:
        print(f"done: {step} steps in {trainer.workdir}", flush=True)
    if multi:
        distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
