"""Setting up a process that owns one engine for the rest of its life: the server's engine core and the
benchmarks' offline side (bench/offline.py) both start this way, so that they run the same engine alike."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

log = logging.getLogger(__name__)


def own_engine(engine_factory: Callable[[], Any], reserved_cores: int = 0, env: dict[str, str] | None = None) -> Any:
    """``env`` set (before torch meets a device), torch's CPU threads (engine/threads.py, ``reserved_cores``
    kept for other processes of ours), the engine built, then every start-up object frozen (engine/heap.py)."""
    from specserve.engine.heap import freeze_startup_heap
    from specserve.engine.threads import set_cpu_threads

    os.environ.update(env or {})
    set_cpu_threads(reserved=reserved_cores)
    engine = engine_factory()
    frozen = freeze_startup_heap()  # the engine lives as long as this process
    log.info("moved %d start-up objects out of the garbage collector's reach", frozen)
    return engine
