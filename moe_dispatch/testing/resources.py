"""What a process holds, for leak checks (tests, ``benchmarks/soak.py``): Linux ``/proc``, and
torch.distributed's process groups."""

from __future__ import annotations

import os

import torch.distributed as dist


def process_resources() -> dict[str, int]:
    """This process's ``threads`` (OS threads), ``fds`` (open file descriptors), ``shm_files``
    (its own ``/dev/shm/moe_dispatch-<pid>-*`` files), ``shm_mappings`` (mapped regions of
    such files, its peers' included), ``rss_kib`` (resident set size, KiB) and ``groups`` (the
    process groups c10d holds, the world's included; 0 before ``init_process_group``)."""
    pid = os.getpid()
    with open("/proc/self/maps") as maps:
        mapped = sum("/dev/shm/moe_dispatch-" in line for line in maps)
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "shm_files": sum(name.startswith(f"moe_dispatch-{pid}-") for name in os.listdir("/dev/shm")),
        "shm_mappings": mapped,
        "rss_kib": rss,
        "groups": len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0,
    }
