"""transformers' own load of the SmolLM2 GGUF (its GGUF loader takes ~20-30 s on two cores), kept
for the test modules that compare against it (test_engine_e2e, then test_loader, which frees it
when it is done), instead of loaded once per module."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

_models: dict[str, torch.nn.Module] = {}
_readers: dict = {}  # gguf_parsed_once's parses, kept until release()


def hf_smollm2() -> torch.nn.Module:
    """The float32 transformers model of the default GGUF, in eval mode (callers only read it)."""
    if "model" not in _models:
        from transformers import AutoModelForCausalLM

        from specserve.loader import default_model_path

        path = default_model_path()
        with gguf_parsed_once():
            _models["model"] = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
            ).eval()
    return _models["model"]


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers' GGUF loads parse the file anew each (config, weights, tokenizer: ~8 s each on two
    cores, most of it np.memmap's slicing hooks) and build gguf's tensor-name map once per submodule (~400
    times, ~11 s): each built once instead, the reader over the same bytes as a plain ndarray (the loads
    only read them), so what they load is still transformers' own."""
    import gguf

    from specserve.loader.gguf import array_reader

    make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, *a, **kw):
        key = (os.fspath(path), a, tuple(sorted(kw.items())))
        if key not in _readers:
            _readers[key] = array_reader(path) if not a and not kw else make_reader(path, *a, **kw)
        return _readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map


def release() -> None:
    _models.clear()
    _readers.clear()
