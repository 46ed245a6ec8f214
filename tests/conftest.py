import gc
import os
import shutil
import tempfile

import pytest
import torch

# one cache (GGUF conversions, cost profiles) per test session, removed at its end: tests neither read
# nor write the user's ~/.cache/specserve, and a fresh machine's run is what every run is
_SESSION_CACHE = tempfile.mkdtemp(prefix="specserve-tests-")
_CACHE_BEFORE = os.environ.get("SPECSERVE_CACHE_DIR")
os.environ["SPECSERVE_CACHE_DIR"] = _SESSION_CACHE

import triton_interpreter  # noqa: E402  (after the cache dir: it imports specserve)

triton_interpreter.prepare()  # before any test module imports the kernels

# OMP_NUM_THREADS where set (make test: 2): more threads than free cores spin and run several times slower
torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS") or os.environ.get("OMP_NUM_THREADS") or 2))


def pytest_unconfigure(config):
    if _CACHE_BEFORE is None:
        os.environ.pop("SPECSERVE_CACHE_DIR", None)
    else:
        os.environ["SPECSERVE_CACHE_DIR"] = _CACHE_BEFORE
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _triton_interpreter_env(request):
    """TRITON_INTERPRET=1 while a module that tests the Triton kernels on the CPU runs (interpreted
    kernels, and the CPU triton backend's check, read it at run time), and in no other module."""
    if not (triton_interpreter.uses_interpreter() and hasattr(request.module, "triton_tests_device")):
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _restore_environment():
    """Whatever a test sets in os.environ is undone after it."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def chat_prompts():
    """20 short first-turn ShareGPT prompts (fixed seed), as chat messages."""
    from specserve.bench.datasets import sharegpt_prompts

    return [[{"role": "user", "content": p.prompt}] for p in sharegpt_prompts(20, seed=0, max_chars=400)]


@pytest.fixture(autouse=True)
def _free_engines():
    """Engines hold a drafter that points back at them: collect such cycles (and their weights and
    KV caches) after every test instead of whenever the garbage collector next runs."""
    yield
    gc.collect()
