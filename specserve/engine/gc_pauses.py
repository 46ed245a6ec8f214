"""Time the garbage collector's full collections pause this process, so that measured step and
cycle times can leave those pauses out.

A full (generation-2) collection walks every live Python object: 30-110 ms in a process holding
SmolLM2 and its tokenizer on a 2-core CPU, more in a test session that has imported the server
stack. One landing in one of the first cycles an arm is measured on made that arm look 2-4x
slower than it is (the adaptive controller then kept a useless draft depth on). The pause is the
process's, not the arm's. Younger collections stay in: they are short and scale with what a step
allocates."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Iterator

_total = 0.0  # seconds in full collections since install()
_started: float | None = None


def _on_gc(phase: str, info: dict) -> None:
    global _total, _started
    if info.get("generation") != 2:
        return
    if phase == "start":
        _started = time.perf_counter()
    elif _started is not None:
        _total += time.perf_counter() - _started
        _started = None


def install() -> None:
    """Start timing full collections (idempotent)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def clock() -> float:
    """time.perf_counter() less the full collections' pauses so far: the difference of two readings
    is the time the process ran between them, pauses left out."""
    return time.perf_counter() - _total


def pause_seconds() -> float:
    """Seconds spent in full collections since install(): differences of two readings time the
    pauses between them."""
    return _total


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Collect garbage first, then none while graphs are captured: torch no longer collects before a
    capture, and a collection inside one could free another engine's objects (pinned buffers record
    events on the capturing stream), which invalidates it (a plain engine built after speculative ones,
    in one test process)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
