"""benchmarks/gpu_decode.py as a dry run on the CPU (--tiny): every section the GPU run takes without a
device (decode against the floor, the verify curve, one layer's attention, and decode again over an fp8
K/V cache) completes and lands in the JSON, so a lease's minutes are not spent on a crash."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # a benchmark's smoke test


def test_gpu_decode_dry_run_with_an_fp8_cache_alongside(tmp_path):
    out = tmp_path / "d.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_decode.py"), "--tiny", "--also-kv-cache-dtype", "fp8",
                    "--batches", "1,2", "--verify-tokens", "1,4", "--iters", "2", "--context", "32", "--no-unfused",
                    "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    d = json.loads(out.read_text())
    assert d["errors"] == [] and d["kv_cache_dtype"] == "float32"
    assert [r["batch"] for r in d["decode"]] == [1, 2] and all(r["forward_ms"] > 0 for r in d["decode"])
    assert [(r["requests"], r["tokens"]) for r in d["verify_curve"]] == [(1, 1), (1, 4), (1, 1), (4, 4)]  # (16 requests share at most T tokens)
    other = d["decode_other_kv_dtype"]
    assert [r["kv_cache_dtype"] for r in other] == ["float8_e4m3fn"] * 2
    assert all(r["forward_ms"] > 0 and r["main_forward_ms"] > 0 for r in other)
    assert [(r["batch"], r["variant"]) for r in d["attention_layer_other_kv_dtype"]] == [(1, "default"), (2, "default")]
    assert all(r["us"] > 0 for r in d["attention_layer_other_kv_dtype"])
