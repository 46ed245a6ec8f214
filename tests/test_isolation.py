"""The suite's own isolation (conftest): a cache of its own, the Triton interpreter only where asked for."""

import os
import tempfile

import triton_interpreter


def test_caches_are_the_sessions_own():
    cache = os.environ["SPECSERVE_CACHE_DIR"]
    assert os.path.dirname(cache) == tempfile.gettempdir() and os.path.isdir(cache)
    assert os.environ["MPLCONFIGDIR"].startswith(cache)
    from specserve.loader.gguf import cache_root

    assert cache_root() == cache


def test_the_triton_interpreter_is_on_only_in_the_kernel_modules():
    """Outside the modules that call triton_tests_device, TRITON_INTERPRET is unset; the kernels were
    decorated for the interpreter all the same (conftest imported them under it)."""
    if not triton_interpreter.uses_interpreter():
        return  # CUDA: the kernels compile, nothing to scope
    assert "TRITON_INTERPRET" not in os.environ
    from triton.runtime.interpreter import InterpretedFunction

    from specserve.models import triton_ops

    kernels = [v for v in vars(triton_ops).values() if hasattr(v, "fn") and hasattr(v, "run")]
    assert kernels and all(isinstance(k, InterpretedFunction) for k in kernels)
