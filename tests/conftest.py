import gc
import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS", "2")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
