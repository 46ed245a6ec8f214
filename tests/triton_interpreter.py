"""Run the Triton kernels on the CPU through Triton's interpreter (tests only).

Call ``triton_tests_device()`` at the top of a test module, before anything imports
``specserve.attention.triton_backend`` or ``specserve.models.triton_ops``: TRITON_INTERPRET is
read when the kernels are decorated.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch


def triton_tests_device() -> torch.device:
    """Skip the module without triton; without CUDA switch to the interpreter. The device to test on."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton to run the Triton kernel tests)",
                    allow_module_level=True)
    if torch.cuda.is_available():
        return torch.device("cuda")
    use_triton_interpreter()
    return torch.device("cpu")


def use_triton_interpreter() -> None:
    kernels = ("specserve.attention.triton_backend", "specserve.models.triton_ops")
    if any(m in sys.modules for m in kernels) and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 could be set",
                    allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
    _interpreter_numpy2_compat()


def _interpreter_numpy2_compat() -> None:
    """Triton 3.6's interpreter turns scalars into 1-element arrays and `range(0, n)` then
    calls int() on them, which numpy >= 2.3 refuses; give tensors an __index__ that works."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_specserve_compat", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._specserve_compat = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
