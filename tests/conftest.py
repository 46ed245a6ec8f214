"""What every test shares (fixtures other test modules reuse are listed here).

- The session's own cache dir (SPECSERVE_CACHE_DIR: GGUF conversions, cost profiles), removed at the end.
- ``smollm2``: the real SmolLM2, plain decoding, built once a session, for tests that only read outputs.
- ``chat_prompts``: 20 short ShareGPT prompts as chat messages.
- ``smollm2_server`` / ``smollm2_spec_server``: SmolLM2 served in a thread (plain; static chains with the
  shipped head), each started once a session for the modules that only send it requests.
- ``_small_kv_budgets`` (autouse): a CPU engine built with the default 2 GB KV budget fails its test;
  pass ``num_kv_blocks`` or ``kv_cache_memory_gb`` (0.05 GB: ~100k tokens of tests/tiny_model.py's
  models, ~1k of SmolLM2).
- ``_explicit_cpu_dtype`` (autouse): a CPU engine built with dtype "auto" (bf16 or fp32 by the CPU's
  features) fails its test; pass ``dtype``.
- ``_cost_profiles`` (autouse): adaptive engines' start-up cost profiles measured at most once a
  session (SmolLM2's read from tests/golden/cost_profiles.json where it holds them).
- TRITON_INTERPRET=1 only in modules with ``triton_tests_device``; os.environ restored after each test.
- A garbage collection after each test (engines' cycles freed at once) walks only what the test made: what
  is alive after it is frozen; at a module's end everything is collected, frozen objects included, where
  over 2,000 objects were frozen since the last such collection (any engine is more).

``make test`` runs everything; ``-m "not slow"`` leaves out the benchmark smoke tests.
"""

import copy
import gc
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

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


def pytest_addoption(parser):
    parser.addoption("--record-cost-profiles", action="store_true",
                     help="measure the real SmolLM2's start-up cost profiles anew and write them to "
                          "tests/golden/cost_profiles.json (see _cost_profiles)")


def pytest_unconfigure(config):
    for k, v in _ENV_BEFORE.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_collection_finish(session):
    _collect_all_and_freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if getattr(nextitem, "module", None) is not item.module:  # (the module's fixtures are torn down by now)
        if gc.get_freeze_count() - _frozen_at_full_collection[0] > _FROZEN_WITHOUT_FULL_COLLECTION:
            _collect_all_and_freeze()


# an engine is over 4,000 objects (a tiny model's ~7,000): one frozen since the last full collection makes
# the next module end collect everything; a module of small objects alone (~0.3 s a full collection) does not
_FROZEN_WITHOUT_FULL_COLLECTION = 2_000
_frozen_at_full_collection = [0]


def _collect_all_and_freeze():
    """A full collection of everything, frozen objects included, then what is alive frozen out of the
    collector's generations (imports, session fixtures; the heap of imports alone is ~200k objects)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _frozen_at_full_collection[0] = gc.get_freeze_count()


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


@pytest.fixture(scope="session", autouse=True)
def _small_kv_budgets():
    """An engine built in this process on the CPU with the default KV budget (2 GB: 2-5 s of zeroing
    per engine, ~90 of them made the suite minutes slower) fails its test: pass ``num_kv_blocks`` or
    ``kv_cache_memory_gb`` sized to what the test needs (0.05 GB: ~100k tokens of the tiny model,
    ~1k of SmolLM2)."""
    import dataclasses

    from specserve.config import EngineConfig
    from specserve.engine import engine

    default = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "kv_cache_memory_gb")
    sized = engine.num_kv_blocks_for

    def checked(config, mc, dtype, device, *a, **kw):
        if device.type == "cpu" and config.num_kv_blocks is None and config.kv_cache_memory_gb == default:
            pytest.fail(f"a test engine with the default {default} GB CPU KV budget: pass num_kv_blocks or "
                        "kv_cache_memory_gb (tests/conftest.py: _small_kv_budgets)", pytrace=False)
        return sized(config, mc, dtype, device, *a, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(engine, "num_kv_blocks_for", checked)
    yield
    mp.undo()


@pytest.fixture(scope="session", autouse=True)
def _explicit_cpu_dtype():
    """An engine built in this process on the CPU with dtype "auto" fails its test: "auto" is bfloat16 on a
    CPU with bf16 units and float32 on others, so what the test sees would depend on the machine. Pass
    ``dtype`` (float32 where outputs are compared with transformers or with plain decoding)."""
    from specserve.engine import engine

    resolve = engine.resolve_dtype

    def checked(name, device):
        if name == "auto" and device.type == "cpu":
            pytest.fail("a test engine with dtype auto on the CPU: pass dtype (tests/conftest.py: "
                        "_explicit_cpu_dtype)", pytrace=False)
        return resolve(name, device)

    mp = pytest.MonkeyPatch()
    mp.setattr(engine, "resolve_dtype", checked)
    yield
    mp.undo()


COST_PROFILES = Path(__file__).parent / "golden" / "cost_profiles.json"


@pytest.fixture(scope="session", autouse=True)
def _cost_profiles(request):
    """Adaptive engines' start-up cost profiles (speculative/profile.py), each measured at most once a session.

    A profile is measured, then kept in the session's cache dir, so the next engine with its key loads it.
    The real SmolLM2's (tens of seconds each on two cores) come instead from tests/golden/cost_profiles.json where it holds the key (the profile key
    without the thread count): the engines' costs relative to one another, which the adaptive tests act on
    (online measurements refine them, as on any machine). ``pytest --record-cost-profiles`` with the tests
    that build adaptive SmolLM2 engines (test_spec_engine, test_overlap_schedule, test_engine_spec_edges)
    writes theirs there, on a quiet machine: a noisy measurement is not recorded."""
    from specserve.engine.engine import served_model_name
    from specserve.speculative import profile
    from specserve.speculative.policy.cost_model import CostModel

    record = request.config.getoption("--record-cost-profiles")
    shipped = {} if record or not COST_PROFILES.exists() else json.loads(COST_PROFILES.read_text())
    load = profile.load_or_profile_costs

    def shipped_key(d) -> str:  # [..., device, dtype, threads, ...] -> [..., device, dtype, *, ...]
        key = profile.cost_profile_key(d.engine, d.head.config, d.cfg.resolved_num_draft_tokens,
                                       d.runner.graphs is not None)
        return key.replace(f"|{d.engine.dtype}|{torch.get_num_threads()}|", f"|{d.engine.dtype}|*|", 1)

    def from_file(key: str):
        cost = CostModel.from_json(copy.deepcopy(shipped[key]))
        cost.meta.update(noisy=False, recorded=cost.meta.get("date"))  # (so the engine caches it)
        return cost

    def load_once(d):
        key = shipped_key(d)
        if key in shipped:  # the engine's own cache path, the measurement replaced by the file's
            with pytest.MonkeyPatch.context() as m:
                m.setattr(profile, "profile_costs", lambda d: from_file(key))
                return load(d)
        cost, path = load(d)
        if cost.meta.get("source", "").startswith("profiled"):
            if not os.path.exists(path):  # (noisy: the engine did not cache it)
                cost.save(path)
            if record and d.engine.model_name == served_model_name(None) and d.device.type == "cpu":
                if cost.meta.get("noisy"):
                    warnings.warn(f"cost profile not recorded (measured on a busy machine): {key}")
                    return cost, path
                old = json.loads(COST_PROFILES.read_text()) if COST_PROFILES.exists() else {}
                COST_PROFILES.write_text(json.dumps({**old, key: cost.to_json()}, indent=0, sort_keys=True) + "\n")
        return cost, path

    load_once.__wrapped__ = load  # (tests of the loader itself call the engine's own)
    mp = pytest.MonkeyPatch()
    mp.setattr(profile, "load_or_profile_costs", load_once)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2 with plain decoding (float32), built once a session for the tests that only read
    its outputs (each engine costs seconds to build): a test leaves it as it found it, with no request
    left in it and nothing of it replaced. 4,096 tokens of KV, prefill steps of up to 512 tokens."""
    from specserve import LLM

    return LLM(dtype="float32", max_num_batched_tokens=512, num_kv_blocks=256)


@pytest.fixture(scope="session")
def smollm2_server():
    """The real SmolLM2 served (plain decoding; a 512-token context, 96 blocks, 8 sequences) for
    test_bench_live and test_server: a test leaves no request in it."""
    from functools import partial

    from specserve.config import EngineConfig
    from specserve.server.launch import build_engine, serve_in_thread

    config = EngineConfig(dtype="float32", max_model_len=512, num_kv_blocks=96, max_num_seqs=8)
    with serve_in_thread(partial(build_engine, config), startup_timeout=120) as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_spec_server():
    """The real SmolLM2 served with speculation (the shipped EAGLE-3 head, static chains of 3; a 1,024-token
    context, 64 blocks, 4 sequences) for test_server and test_server_structured."""
    from functools import partial

    from specserve.config import EngineConfig
    from specserve.server.launch import build_engine, serve_in_thread

    config = EngineConfig.from_kwargs(dtype="float32", max_model_len=1024, num_kv_blocks=64, max_num_seqs=4,
                                      speculative_algorithm="EAGLE3", speculative_policy="static",
                                      speculative_num_steps=3)
    with serve_in_thread(partial(build_engine, config), startup_timeout=300) as server:
        yield server


@pytest.fixture(scope="session")
def chat_prompts():
    """20 short first-turn ShareGPT prompts (fixed seed), as chat messages."""
    from specserve.bench.datasets import sharegpt_prompts

    return [[{"role": "user", "content": p.prompt}] for p in sharegpt_prompts(20, seed=0, max_chars=400)]


@pytest.fixture(autouse=True)
def _free_engines():
    """Engines hold a drafter that points back at them: collect such cycles (and their weights and
    KV caches) after every test instead of whenever the garbage collector next runs. What is still
    alive then (module and session fixtures, imports) is frozen until the module's end, so the next
    test's collection walks only what that test made."""
    yield
    gc.collect()
    gc.freeze()
