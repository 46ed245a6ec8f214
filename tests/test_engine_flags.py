"""Engine flags reach what they configure: --no-cpu-weight-packing and --tokenizer (LLM(tokenizer=...)); dtype
auto by the CPU's features."""

from __future__ import annotations

import argparse

import pytest
import torch

from specserve import LLM
from specserve.engine.engine import resolve_dtype
from specserve.engine.args import add_engine_args, engine_config_from_args
from specserve.models.cpu_packing import cpu_packing_available
from tiny_model import make_tiny_model


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_cpu_weight_packing_flag_reaches_the_config():
    assert parse().cpu_weight_packing is True
    assert parse("--no-cpu-weight-packing").cpu_weight_packing is False


def test_tokenizer_flag_reaches_the_config(tmp_path):
    assert parse().tokenizer is None
    assert parse("--tokenizer", str(tmp_path)).tokenizer == str(tmp_path)


def test_the_engine_uses_the_tokenizer_it_is_given(tmp_path):
    model = make_tiny_model(str(tmp_path / "model"), vocab=64)
    other = make_tiny_model(str(tmp_path / "other"), vocab=8)  # its words: t0..t7 (t20 is unknown: t0)
    own = LLM(dtype="float32", model=model, device="cpu", kv_cache_memory_gb=0.01)
    given = LLM(dtype="float32", model=model, tokenizer=other, device="cpu", kv_cache_memory_gb=0.01)
    assert own.tokenizer.encode("t20") == [20]
    assert given.tokenizer.encode("t20") == [0]
    unpacked = LLM(dtype="float32", model=model, device="cpu", kv_cache_memory_gb=0.01, cpu_weight_packing=False)
    available = cpu_packing_available(own.engine.device, own.engine.dtype)
    assert bool(own.engine.packed_linears) == available and unpacked.engine.packed_linears == 0


@pytest.mark.parametrize("caps,want", [({"avx512_bf16": True}, torch.bfloat16), ({"amx_bf16": True}, torch.bfloat16),
                                       ({"avx512_bf16": False, "avx2": True}, torch.float32)])
def test_dtype_auto_is_bf16_only_on_a_cpu_with_bf16_units(monkeypatch, caps, want):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert resolve_dtype("auto", torch.device("cpu")) == want
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
