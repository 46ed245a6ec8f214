"""torch's CPU thread pool: one thread per physical core, less those a server's front-ends need and
those other processes keep busy at start-up (the 1-minute load average).

More compute threads than free cores is the slow case: every parallel region waits for its slowest
thread, and one that shares its core with another process waits a time slice (SmolLM2 decoding on two
cores with a busy machine: 0.5 tok/s with 2 threads, 5.7 with 1). OMP_NUM_THREADS, where set, is kept.
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


def busy_cores() -> int:
    """Cores other processes keep busy: the 1-minute load average, rounded."""
    try:
        return int(os.getloadavg()[0] + 0.5)
    except OSError:
        return 0


def default_num_threads(reserved: int = 0, busy: int | None = None) -> int:
    """Physical cores less ``reserved`` (our own front-ends) or, if more, less the ``busy`` ones; at least one."""
    cores = physical_cores()
    busy = busy_cores() if busy is None else busy
    return max(1, min(cores - reserved, cores - busy))


def set_cpu_threads(reserved: int = 0) -> int:
    """Set torch's intra-op threads to default_num_threads(reserved) unless OMP_NUM_THREADS is set; the count."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        why = "OMP_NUM_THREADS"
    else:
        busy = busy_cores()
        torch.set_num_threads(default_num_threads(reserved, busy))
        why = f"{physical_cores()} physical cores, {reserved} kept for the front-end, load average {busy}"
    n = torch.get_num_threads()
    log.info("torch CPU threads: %d (%s; OMP_NUM_THREADS overrides)", n, why)
    return n
