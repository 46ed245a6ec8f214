"""Run the Triton kernels on the CPU through Triton's interpreter (tests only).

``prepare()`` (conftest, before any test module is imported): without CUDA, the kernel modules
are imported once with TRITON_INTERPRET=1 (read when a kernel is decorated), then the variable
is restored. A test module that calls ``triton_tests_device()`` runs with TRITON_INTERPRET=1
(conftest's module fixture: interpreted kernels and the CPU triton backend read it at run time).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys

import pytest
import torch

KERNEL_MODULES = ("specserve.attention.triton_backend", "specserve.models.triton_ops")
# where pyproject's test extra installs triton (its environment marker)
TRITON_REQUIRED = sys.platform == "linux" and platform.machine() == "x86_64"
_prepared = False


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_interpreter() -> bool:
    return not torch.cuda.is_available() and triton_installed()


def prepare() -> None:
    """Decorate the kernels for the interpreter (no CUDA): import their modules with TRITON_INTERPRET=1."""
    global _prepared
    if not uses_interpreter():
        return
    if any(m in sys.modules for m in KERNEL_MODULES):
        raise RuntimeError(f"{KERNEL_MODULES} were imported before the Triton interpreter was set up")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    try:
        _interpreter_numpy2_compat()
        for m in KERNEL_MODULES:
            importlib.import_module(m)
    finally:
        mp.undo()
    _prepared = True


def triton_tests_device() -> torch.device:
    """The device the calling module tests the Triton kernels on: CUDA, else the CPU (interpreter).

    A missing triton fails the module where the project declares it (linux x86-64); elsewhere it skips."""
    if not triton_installed():
        if TRITON_REQUIRED:
            raise ImportError("triton is a declared dependency on linux x86-64 but is not installed "
                              "(pip install -e '.[test]')")
        pytest.skip("triton is not a dependency on this platform", allow_module_level=True)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not _prepared:
        raise RuntimeError("the Triton interpreter was not set up: tests/conftest.py calls prepare()")
    return torch.device("cpu")


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
