import gc
import os
import shutil
import tempfile

import pytest
import torch

# one cache (GGUF conversions, cost profiles, matplotlib's) per test session, removed at its end: tests
# neither read nor write the user's HOME, and a fresh machine's run is what every run is
_SESSION_CACHE = tempfile.mkdtemp(prefix="specserve-tests-")
_SESSION_ENV = {"SPECSERVE_CACHE_DIR": _SESSION_CACHE,
                "MPLCONFIGDIR": os.path.join(_SESSION_CACHE, "matplotlib")}  # (the plots' font cache: not in HOME)
_ENV_BEFORE = {k: os.environ.get(k) for k in _SESSION_ENV}
os.environ.update(_SESSION_ENV)

import triton_interpreter  # noqa: E402  (after the cache dir: it imports specserve)

triton_interpreter.prepare()  # before any test module imports the kernels

# OMP_NUM_THREADS where set (make test: 2): more threads than free cores spin and run several times slower
torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS") or os.environ.get("OMP_NUM_THREADS") or 2))


def pytest_unconfigure(config):
    for k, v in _ENV_BEFORE.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
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
