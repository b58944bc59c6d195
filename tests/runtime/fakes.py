"""Stand-in devices of hosts this machine does not have (mesh construction only looks at the objects)."""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def hosts(num_hosts: int, per_host: int, seed: int = 0) -> list[FakeDevice]:
    """Devices of ``num_hosts`` hosts with ``per_host`` each, in a shuffled order (as a cluster may list them)."""
    devices = [FakeDevice(h * 1000 + i, h) for h in range(num_hosts) for i in range(per_host)]
    random.Random(seed).shuffle(devices)
    return devices
