"""torch's CPU thread pool: one thread per physical core, less those a server's front-ends need.

More compute threads than free cores is the slow case: OpenMP threads spin at their barriers while the
core they wait for runs another process (a decode step took ~10x longer with one busy neighbour).
OMP_NUM_THREADS, where set, is the user's choice and is kept.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads counted once)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f, open(f"{base}/core_id") as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology (containers, other systems): one core per CPU
    return max(1, len(cores))


def default_num_threads(reserved: int = 0) -> int:
    """Physical cores less ``reserved`` (the cores other busy processes of ours need), at least one."""
    return max(1, physical_cores() - reserved)


def set_cpu_threads(reserved: int = 0) -> int:
    """Set torch's intra-op threads to default_num_threads(reserved) unless OMP_NUM_THREADS is set; the count."""
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(default_num_threads(reserved))
    n = torch.get_num_threads()
    log.info("torch CPU threads: %d (%s)", n, "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS")
             else f"{physical_cores()} physical cores, {reserved} left to the front-end" if reserved
             else "physical cores")
    return n
