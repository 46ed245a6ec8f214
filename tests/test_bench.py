"""Serving benchmark: measured against a fake streaming server with known timings, plus pure logic.

The fake server (specserve/bench/fake_server.py) sends its first chunk after TTFT and one chunk per
ITL after that; the benchmark must measure those values, account for every request and keep its
JSON keys stable. The served-vs-offline benchmark's offline process runs the real SmolLM2 here (slow);
the serving client against a real server is in test_bench_live.py.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from specserve.bench.client_processes import ClientProcesses
from specserve.bench.datasets import BenchRequest, load_jsonl_requests, sample_random_requests, sample_sharegpt_requests
from specserve.bench.fake_server import FakeSpec, ThreadedServer, make_app
from specserve.bench.metrics import (
    RequestResult,
    latency_stats,
    metrics_delta,
    parse_prometheus,
    server_info_accept_length,
    spec_from_metrics,
    summarize,
)
from specserve.bench.ramp import RampSpec, expand_doubling, parse_int_list
from specserve.bench.serving import BenchConfig, run_benchmark
from specserve.bench.sweep import ServerConfig, ServerProcess, ServerStartError, free_port, prompts_for, server_command

# The result's top-level keys: tools (sweep tables, plots, BENCHMARKS.md) read these.
RESULT_KEYS = {
    "schema_version", "kind", "started_at", "command", "model", "config", "dataset",
    "num_requests", "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
    "request_throughput", "input_throughput", "output_throughput", "total_token_throughput", "concurrency",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2e_latency")),
    "token_check", "spec_usage", "accept_length", "spec_metrics", "server_info", "server_metrics_delta",
    "errors", "ramp", "requests",
}
TOKEN_CHECK_KEYS = {
    "tokens_counted", "usage_tokens", "stream_tokens", "retokenized_tokens", "requests_without_usage",
    "stream_usage_mismatches", "chunks_exceeding_tokens", "expected_length_mismatches", "consistent",
}


def _requests(n: int, out_len: int) -> list[BenchRequest]:
    return [BenchRequest(prompt=f"prompt number {i} with some words", output_len=out_len) for i in range(n)]


def _run(spec: FakeSpec, reqs: list[BenchRequest], ramp: RampSpec | None = None,
         clients: ClientProcesses | None = None, **cfg_kw) -> dict:
    with ThreadedServer(make_app(spec)) as srv:
        cfg = BenchConfig(base_url=srv.base_url, disable_tqdm=True, **cfg_kw)
        return asyncio.run(run_benchmark(cfg, reqs, ramp=ramp, clients=clients))


# ---------------------------------------------------------------------------------------------
# Against the fake server


def test_fake_server_ttft_itl_tpot_and_schema() -> None:
    res = _run(FakeSpec(ttft_s=0.2, itl_s=0.05), _requests(8, 6), max_concurrency=4, ignore_eos=True,
               save_requests=True)
    assert set(res) == RESULT_KEYS
    assert set(res["token_check"]) == TOKEN_CHECK_KEYS
    assert (res["num_requests"], res["completed"], res["failed"]) == (8, 8, 0)
    assert res["errors"] == []
    # known: first text 200 ms after the request, then 50 ms between chunks (1 token each)
    assert 200 <= res["median_ttft_ms"] <= 320, res["median_ttft_ms"]
    assert 45 <= res["median_itl_ms"] <= 90, res["median_itl_ms"]
    assert 45 <= res["median_tpot_ms"] <= 90, res["median_tpot_ms"]
    assert res["median_e2e_latency_ms"] >= 200 + 5 * 50
    # every token counted once, from usage, and equal to what the stream carried
    assert res["total_output_tokens"] == 48
    tc = res["token_check"]
    assert tc["consistent"] and tc["usage_tokens"] == tc["stream_tokens"] == 48
    assert res["total_input_tokens"] == 8 * 6  # the fake counts words
    assert res["concurrency"] <= 4 + 1e-6
    assert len(res["requests"]) == 8 and all(r["chunks"] == 6 and len(r["itl_ms"]) == 5 for r in res["requests"])
    # the chat stream opens with an empty role chunk: TTFT must not stop there
    assert all(r["ttft_ms"] >= 200 for r in res["requests"])
    assert res["accept_length"]["usage"] == 1.0
    json.dumps(res)  # serializable as is


def test_multi_token_chunks_spec_stats_from_usage_metrics_and_server_info() -> None:
    # 3 tokens per chunk: a speculative server committing 3 tokens per verify step
    res = _run(FakeSpec(ttft_s=0.1, itl_s=0.05, tokens_per_chunk=3, draft_k=3), _requests(4, 9),
               max_concurrency=2, ignore_eos=True, endpoint="completions")
    assert res["completed"] == 4 and res["total_output_tokens"] == 36
    # TPOT spreads the two 50 ms gaps over 8 tokens; ITL is per chunk
    assert 12.5 <= res["median_tpot_ms"] <= 25, res["median_tpot_ms"]
    assert 45 <= res["median_itl_ms"] <= 90
    assert res["accept_length"] == {"server_info": 3.0, "usage": 3.0, "metrics": 3.0}
    sm = res["spec_metrics"]
    assert sm["mean_k"] == 3.0 and sm["k_counts"] == {"3": 12.0} and sm["k0_share"] == 0.0
    assert sm["spec_step_share"] == 1.0 and sm["acceptance_rate"] == pytest.approx(2 / 3)
    assert res["spec_usage"]["verify_steps"] == 12 and res["spec_usage"]["accepted_tokens"] == 24


def test_failed_requests_are_counted_not_dropped() -> None:
    # requests 3, 6, 9 answer HTTP 500; the streams of 4 and 8 stop without [DONE]
    res = _run(FakeSpec(ttft_s=0.01, itl_s=0.01, fail_every=3, break_every=4), _requests(9, 3),
               max_concurrency=3, warmup_requests=0)
    assert (res["num_requests"], res["completed"], res["failed"]) == (9, 4, 5)
    errors = {e["error"][:8]: e["count"] for e in res["errors"]}
    assert errors == {"HTTP 500": 3, "stream e": 2}, res["errors"]
    assert res["total_output_tokens"] == 4 * 3


def test_poisson_arrivals_follow_the_seeded_schedule() -> None:
    import numpy as np

    res = _run(FakeSpec(ttft_s=0.01, itl_s=0.01), _requests(4, 2), request_rate=5.0, seed=7,
               warmup_requests=0, save_requests=True)
    gaps = np.random.default_rng(7).exponential(1 / 5.0, size=4)
    starts = sorted(r["start_s"] for r in res["requests"])
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    assert res["completed"] == 4
    assert all(s >= a - 1e-3 for s, a in zip(starts, arrivals)), (starts, arrivals)  # never early


def test_unreachable_server_fails_warmup_with_the_reason() -> None:
    cfg = BenchConfig(base_url=f"http://127.0.0.1:{free_port()}", disable_tqdm=True, model="m")
    with pytest.raises(RuntimeError, match="warmup requests .* failed; first error: ConnectError"):
        asyncio.run(run_benchmark(cfg, _requests(2, 2)))


def test_ramp_windows_follow_the_schedule() -> None:
    ramp = RampSpec((1, 3, 1), 0.6)
    res = _run(FakeSpec(ttft_s=0.02, itl_s=0.02), _requests(5, 4), ramp=ramp, window_s=0.3, ignore_eos=True)
    r = res["ramp"]
    assert res["kind"] == "ramp" and res["failed"] == 0 and res["completed"] > 0
    assert [w["target_concurrency"] for w in r["windows"]] == [1, 1, 3, 3, 1, 1]
    assert [s["concurrency"] for s in r["steps"]] == [1, 3, 1]
    # tokens in windows + tokens after the schedule = all tokens
    in_windows = sum(w["output_tokens"] for w in r["windows"])
    assert 0 < in_windows <= res["total_output_tokens"]
    assert max(w["mean_inflight"] for w in r["windows"]) <= 3 + 1e-6
    assert r["windows"][2]["mean_inflight"] > r["windows"][0]["mean_inflight"]
    assert all(w["mean_k"] in (None, 3.0) for w in r["windows"])
    assert any(w["mean_k"] == 3.0 for w in r["windows"])


@pytest.fixture(scope="module")
def two_clients():
    """Two client processes, started once for the module's loads split over them (each load a run of its own)."""
    clients = ClientProcesses(2)
    yield clients
    clients.close()


def test_ramp_split_over_client_processes(two_clients) -> None:
    """Two client processes share each level (4 -> 2 + 2) on one clock: the windows see the whole level, never
    more (each process running the whole ramp would keep 8 in flight), and the parent's /metrics series."""
    res = _run(FakeSpec(ttft_s=0.02, itl_s=0.02), _requests(6, 4), ramp=RampSpec((1, 4, 1), 0.8), clients=two_clients,
               window_s=0.4, ignore_eos=True, save_requests=True)
    r = res["ramp"]
    assert res["failed"] == 0 and res["completed"] > 0 and res["token_check"]["consistent"]
    assert [w["target_concurrency"] for w in r["windows"]] == [1, 1, 4, 4, 1, 1]
    assert max(w["mean_inflight"] for w in r["windows"]) <= 4 + 1e-6
    assert min(w["mean_inflight"] for w in r["windows"][2:4]) > 2.5  # both processes' streams
    assert max(w["mean_inflight"] for w in (r["windows"][0], r["windows"][5])) <= 1 + 1e-6
    assert len({q["index"] for q in res["requests"]}) == res["num_requests"]
    assert any(w["mean_k"] == 3.0 for w in r["windows"])


def test_bench_serve_cli_writes_json(tmp_path: Path) -> None:
    from specserve.cli import main as specserve_main

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello there", "output_len": 3}\n{"prompt": "general kenobi"}\n')
    out = tmp_path / "r.json"
    with ThreadedServer(make_app(FakeSpec(ttft_s=0.01, itl_s=0.01))) as srv:
        specserve_main(["bench", "serve", "--base-url", srv.base_url, "--dataset", "jsonl", "--jsonl-path",
                        str(data), "--jsonl-output-len", "5", "--num-prompts", "2", "--max-concurrency", "2",
                        "--ignore-eos", "--disable-tqdm", "--quiet", "--output-file", str(out)])
    res = json.loads(out.read_text())
    assert set(res) == RESULT_KEYS
    assert res["completed"] == 2 and res["total_output_tokens"] == 8 and res["token_check"]["consistent"]
    assert res["command"].startswith("specserve bench serve") or "bench" in res["command"]


# ---------------------------------------------------------------------------------------------
# Sweep: server subprocesses (the fake server) and tables/plots


FAKE_CMD = "{python} -m specserve.bench.fake_server --port {port} --ttft 0.02 --itl 0.01"


def test_server_process_is_stopped_and_start_failures_are_explained(tmp_path: Path) -> None:
    port = free_port()
    cmd = server_command(FAKE_CMD, (), "127.0.0.1", port, None)
    with ServerProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "ok.log", 60) as srv:
        assert srv.alive
    assert srv.proc is not None and srv.proc.poll() is not None  # stopped on exit

    cmd = server_command(FAKE_CMD, ("--crash",), "127.0.0.1", port, None)
    with pytest.raises(ServerStartError, match="exited with status 3(.|\n)*crashing on purpose"):
        with ServerProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "crash.log", 60):
            pass

    slow = ServerProcess(server_command(FAKE_CMD, ("--startup-delay", "30"), "127.0.0.1", port, None),
                         f"http://127.0.0.1:{port}", tmp_path / "slow.log", 1.0)
    with pytest.raises(ServerStartError, match="not healthy after 1 s"):
        with slow:
            pass
    assert slow.proc is not None and slow.proc.poll() is not None  # killed, not leaked


def test_sweep_end_to_end_with_fake_servers(tmp_path: Path) -> None:
    from specserve.bench.sweep import cli

    rc = cli(["--server-cmd", FAKE_CMD, "--config", "one=--tokens-per-chunk 1", "--config",
              "two=--tokens-per-chunk 2", "--concurrency", "1,2", "--dataset", "random", "--random-input-len", "8",
              "--random-output-len", "4", "--ignore-eos", "--min-prompts", "2", "--prompts-per-concurrency", "2",
              "--output-dir", str(tmp_path), "--disable-tqdm", "--warmup-requests", "0"])
    assert rc == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sweep["errors"] == {}
    assert [(r["config"], r["concurrency"], r["num_prompts"]) for r in sweep["runs"]] == [
        ("one", 1, 2), ("one", 2, 4), ("two", 1, 2), ("two", 2, 4)]
    assert all(r["result"]["failed"] == 0 and r["result"]["token_check"]["consistent"] for r in sweep["runs"])
    acc = {r["config"]: r["result"]["accept_length"]["usage"] for r in sweep["runs"]}
    assert acc == {"one": 1.0, "two": 2.0}
    for name in ("sweep.png", "throughput_vs_concurrency.png", "tpot_vs_concurrency.png",
                 "accept_length_vs_concurrency.png", "k_vs_concurrency.png", "sweep.md",
                 "server-one.log", "server-two.log"):
        assert (tmp_path / name).stat().st_size > 0, name
    md = (tmp_path / "sweep.md").read_text()
    assert md.startswith("Command: `") and "| C | one | two |" in md and "×)" in md


def _fake_sweep(kind: str = "sweep") -> dict:
    def result(tput: float, tpot: float, al: float | None, k: float | None) -> dict:
        return {"output_throughput": tput, "mean_tpot_ms": tpot, "median_ttft_ms": 10.0, "completed": 4,
                "failed": 0, "request_throughput": 1.0, "p99_itl_ms": 5.0, "median_e2e_latency_ms": 50.0,
                "accept_length": {"usage": al, "metrics": None, "server_info": None},
                "spec_metrics": {"mean_k": k, "k0_share": 0.0}, "token_check": {"consistent": True}}
    runs = [{"config": n, "concurrency": c, "num_prompts": 4, "result": result(t, 10 / t, al, k)}
            for n, al, k, ts in (("none", None, None, (10, 18)), ("static", 2.5, 3.0, (20, 22)))
            for c, t in zip((1, 2), ts)]
    return {"kind": kind, "command": "specserve bench sweep ...", "started_at": "now", "model": None,
            "configs": {"none": "", "static": "--speculative-policy static"}, "baseline": "none",
            "concurrency": [1, 2], "dataset": {"name": "random"}, "runs": runs, "errors": {}}


def test_markdown_pivot_ratios_and_plots(tmp_path: Path) -> None:
    from specserve.bench.plots import plot_sweep, sweep_markdown

    md = sweep_markdown(_fake_sweep())
    assert "| 1 | 10.0 | 20.0 (2.00×) |" in md
    assert "| 2 | 18.0 | 22.0 (1.22×) |" in md
    assert "| 1 | – | 2.50 |" in md  # accept length: none has no speculation
    paths = plot_sweep(_fake_sweep(), tmp_path)
    assert len(paths) == 5 and all(p.stat().st_size > 1000 for p in paths)


def test_ramp_comparison_min_window_ratio() -> None:
    from specserve.bench.plots import ramp_comparison

    def ramp(tputs: list[float], ks: list[float | None]) -> dict:
        ws = [{"t_start_s": i, "t_end_s": i + 1, "output_throughput": t, "output_tokens": t, "mean_k": k,
               "target_concurrency": 1} for i, (t, k) in enumerate(zip(tputs, ks))]
        return {"windows": ws, "steps": [], "levels": [1], "step_duration_s": 3, "window_s": 1}

    sweep = {"baseline": "none", "runs": [
        {"config": "none", "concurrency": None, "result": {"ramp": ramp([10, 10, 10], [None] * 3)}},
        {"config": "adaptive", "concurrency": None, "result": {"ramp": ramp([12, 9.5, 10], [3, 0, 2])}},
        {"config": "chain", "concurrency": None, "result": {"ramp": ramp([20, 5, 5], [5, 5, 5])}},
    ]}
    cmp = ramp_comparison(sweep)
    assert cmp["adaptive"]["min_window_ratio"] == pytest.approx(0.95)
    assert cmp["adaptive"]["windows_below_0.97"] == 1
    assert cmp["adaptive"]["on_off_switches"] == 2
    assert cmp["none"]["min_window_ratio"] is None and cmp["none"]["mean_k"] is None
    # against the better of the others: overall none and chain both 10 tok/s, adaptive 10.5; window by window
    # the best of none and chain: 20, 10, 10
    assert cmp["adaptive"]["ratio_to_best_other"] == pytest.approx(31.5 / 30)
    assert cmp["adaptive"]["min_window_ratio_to_best_other"] == pytest.approx(0.6)
    assert cmp["adaptive"]["windows_below_0.9_of_best_other"] == 1
    assert cmp["chain"]["ratio_to_best_other"] == pytest.approx(30 / 31.5)


# ---------------------------------------------------------------------------------------------
# Pure logic


def test_ramp_spec_and_lists() -> None:
    assert expand_doubling([1, 32, 1]) == [1, 2, 4, 8, 16, 32, 16, 8, 4, 2, 1]
    assert expand_doubling([3, 10]) == [3, 6, 10]
    assert parse_int_list("1, 2,4") == [1, 2, 4]
    with pytest.raises(ValueError, match="comma-separated"):
        parse_int_list("1,x")
    r = RampSpec((1, 8, 2), 5.0)
    assert [r.level_at(t) for t in (0, 4.9, 5, 14.9, 15)] == [1, 1, 8, 2, 0]
    assert RampSpec((0, 2), 1.0).level_at(0.5) == 0  # a level of 0: no load for that step
    for bad in ((0, 0), (1, -1), ()):
        with pytest.raises(ValueError, match="ramp levels"):
            RampSpec(bad, 1.0)
    with pytest.raises(ValueError, match="request_rate"):
        BenchConfig(request_rate=0)
    assert prompts_for(1, 4, 8, 256) == 8 and prompts_for(32, 4, 8, 64) == 64 and prompts_for(64, 4, 8, 32) == 64


def test_server_config_and_command() -> None:
    sc = ServerConfig.parse("static=--speculative-algorithm EAGLE3 --speculative-policy static")
    assert sc.name == "static" and sc.flags == ("--speculative-algorithm", "EAGLE3", "--speculative-policy", "static")
    assert ServerConfig.parse("none=").flags == ()
    with pytest.raises(ValueError, match="NAME="):
        ServerConfig.parse("just-flags")
    cmd = server_command("python -m specserve.cli serve --host {host} --port {port}", sc.flags, "127.0.0.1", 9,
                         "m.gguf")
    assert cmd[-6:] == ["--model", "m.gguf", *sc.flags] and "9" in cmd
    with pytest.raises(ValueError, match="port"):
        server_command("serve", (), "h", 1, None)


HIST_PAGE = """# TYPE x:spec_k_chosen histogram
x:spec_k_chosen_bucket{le="+Inf"} %d
x:spec_k_chosen_sum %d
x:spec_k_chosen_count %d
# TYPE x:spec_accept_length gauge
x:spec_accept_length 2.5
"""

COUNTER_PAGE = """# TYPE specserve:spec_verify_steps_total counter
specserve:spec_verify_steps_total{model_name="m"} %d
# TYPE specserve:spec_accepted_tokens_total counter
specserve:spec_accepted_tokens_total{model_name="m"} %d
# TYPE specserve:spec_accepted_tokens_per_pos_total counter
specserve:spec_accepted_tokens_per_pos_total{model_name="m",position="0"} 999
# TYPE specserve:spec_draft_tokens_total counter
specserve:spec_draft_tokens_total{model_name="m"} %d
# TYPE specserve:spec_k_chosen_total counter
specserve:spec_k_chosen_total{k="0",model_name="m"} %d
specserve:spec_k_chosen_total{k="4",model_name="m"} %d
# TYPE specserve:spec_k_chosen_created gauge
specserve:spec_k_chosen_created{k="0",model_name="m"} 1.7e9
"""


def test_spec_stats_from_metrics_deltas() -> None:
    a = parse_prometheus(COUNTER_PAGE % (10, 5, 40, 1, 10))
    b = parse_prometheus(COUNTER_PAGE % (30, 35, 120, 21, 30))
    assert not any(k.endswith("_created") or "_created{" in k for k in b)
    s = spec_from_metrics(metrics_delta(a, b))
    assert s["accept_length"] == pytest.approx((30 + 20) / 20)  # (accepted + steps) / steps over the window
    assert s["acceptance_rate"] == pytest.approx(30 / 80)
    assert s["mean_k"] == pytest.approx(4 * 20 / 40) and s["k0_share"] == 0.5
    h = spec_from_metrics(metrics_delta(parse_prometheus(HIST_PAGE % (2, 6, 2)),
                                        parse_prometheus(HIST_PAGE % (6, 14, 6))))
    assert h["mean_k"] == 2.0 and h["accept_length"] == 2.5  # no counters: the gauge
    assert spec_from_metrics(None)["mean_k"] is None


def test_server_info_accept_length_both_shapes() -> None:
    assert server_info_accept_length({"avg_spec_accept_length": 2.0}) == 2.0
    assert server_info_accept_length({"internal_states": [{"avg_spec_accept_length": 3.5}]}) == 3.5
    assert server_info_accept_length({"internal_states": [{}]}) is None and server_info_accept_length(None) is None


def test_summary_math_and_token_mismatch_detection() -> None:
    def rr(i: int, n_usage: int, chunks: list[float], expected: int, tokens: list[int | None]) -> RequestResult:
        r = RequestResult(index=i, expected_output_len=expected, success=True, start=0.0, ttft=chunks[0],
                          latency=chunks[-1] + 0.01, chunk_times=chunks, chunk_tokens=tokens,
                          usage={"prompt_tokens": 5, "completion_tokens": n_usage})
        return r

    good = rr(0, 3, [0.1, 0.2, 0.3], 3, [1, 1, 1])
    s = summarize([good], 1.0, ignore_eos=True)
    assert s["mean_tpot_ms"] == pytest.approx((0.31 - 0.1) / 2 * 1e3)
    assert s["mean_itl_ms"] == pytest.approx(100.0)
    assert s["token_check"]["consistent"]
    # the stream carried 4 tokens, usage says 3: caught
    bad = rr(1, 3, [0.1, 0.2, 0.3], 3, [1, 2, 1])
    assert summarize([bad], 1.0, ignore_eos=True)["token_check"]["stream_usage_mismatches"] == 1
    # ignore_eos asked for 5, got 3: caught
    short = rr(2, 3, [0.1, 0.2, 0.3], 5, [None, None, None])
    tc = summarize([short], 1.0, ignore_eos=True)["token_check"]
    assert tc["expected_length_mismatches"] == 1 and not tc["consistent"] and tc["stream_tokens"] is None
    # more text chunks than tokens is impossible: caught
    over = rr(3, 2, [0.1, 0.2, 0.3], 2, [None] * 3)
    assert summarize([over], 1.0, ignore_eos=False)["token_check"]["chunks_exceeding_tokens"] == 1
    empty = summarize([], 1.0, ignore_eos=False)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["output_throughput"] == 0
    assert latency_stats("x", [0.001, 0.003]) == {"mean_x_ms": 2.0, "median_x_ms": 2.0,
                                                  "p90_x_ms": pytest.approx(2.8), "p99_x_ms": pytest.approx(2.98)}


def test_datasets(tmp_path: Path) -> None:
    reqs = sample_random_requests(50, 20, 10, range_ratio=0.5, seed=3)
    assert all(10 <= r.prompt_len <= 20 and 5 <= r.output_len <= 10 for r in reqs)
    assert reqs == sample_random_requests(50, 20, 10, range_ratio=0.5, seed=3)
    with pytest.raises(ValueError, match="range_ratio"):
        sample_random_requests(1, 1, 1, range_ratio=2)
    fixed = sample_sharegpt_requests(5, None, seed=1, fixed_output_len=7)
    assert len(fixed) == 5 and {r.output_len for r in fixed} == {7}
    with pytest.raises(ValueError, match="tokenizer"):
        sample_sharegpt_requests(5, None)
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "output_len": 2}\n\n{"prompt": "b"}\n')
    assert [r.output_len for r in load_jsonl_requests(str(p), default_output_len=9)] == [2, 9]
    with pytest.raises(ValueError, match=r"d.jsonl:3: no \"output_len\""):
        load_jsonl_requests(str(p))
    p.write_text('{"prompt": "a", "output_len": 0}\n')
    with pytest.raises(ValueError, match="positive integer"):
        load_jsonl_requests(str(p))
    assert math.isinf(BenchConfig().request_rate)


def test_client_processes_split_the_streams(two_clients) -> None:
    """Two client processes share 4 streams: every request completes once, and the closed loop keeps 4 in
    flight (8 requests of TTFT 0.2 s + 5 x 0.05 s take two waves, not four or eight)."""
    reqs = [BenchRequest(prompt=f"prompt {i}", output_len=6) for i in range(8)]
    with ThreadedServer(make_app(FakeSpec(ttft_s=0.2, itl_s=0.05))) as srv:
        cfg = BenchConfig(base_url=srv.base_url, max_concurrency=4, disable_tqdm=True)
        assert two_clients.parts(cfg, reqs) == 2
        results, _, duration = two_clients.run(cfg, "fake-model", reqs)
    assert [r.index for r in results] == list(range(8)) and all(r.success for r in results)
    assert sum(r.output_len for r in results) == 48
    assert 2 * 0.45 <= duration < 3 * 0.45 + 1.0, duration


@pytest.mark.slow
def test_offline_side_runs_its_engine_in_a_process_of_its_own() -> None:
    """The served-vs-offline benchmark's offline side: the real SmolLM2 in a spawned process (not this one),
    the chat template applied there, every request's tokens counted once and in its own slot."""
    import os

    from specserve.bench.offline import OfflineProcess
    from specserve.config import EngineConfig

    side = OfflineProcess(EngineConfig(dtype="float32", max_model_len=256, num_kv_blocks=48, max_num_seqs=2), reserved_cores=1)
    try:
        info = side.wait_ready()
        assert info["pid"] == side.proc.pid != os.getpid()
        assert info["cpu_threads"] >= 1 and info["model"]
        prompts = ["Hello there!", "What is two plus two?", "Name a colour."]
        results, duration, steps = side.run(prompts, [3, 5, 7], concurrency=2, ignore_eos=True)
        assert [sum(r.chunk_tokens) for r in results] == [3, 5, 7]
        assert [r.usage["completion_tokens"] for r in results] == [3, 5, 7]
        assert all(r.success and 0 < r.ttft <= r.latency <= duration for r in results)
        tok = info["tokenizer"]
        assert all(r.usage["prompt_tokens"] > len(tok.encode(p)) for r, p in zip(results, prompts))  # chat template
        # 2 in flight until the second request ends (the third took the first's place), then one alone
        assert 0 < steps.steady_steps < steps.steps and steps.mean_step_ms > 0
        assert steps.k_counts is None and steps.goodput is None  # (no speculation)
        assert set(steps.by_batch) == {1, 2} and all(set(kinds) == {"plain"} for kinds in steps.by_batch.values())
        assert sum(k["plain"][0] for k in steps.by_batch.values()) == steps.steps
        assert sum(k["plain"][2] for k in steps.by_batch.values()) == 15
        s = summarize(results, duration, ignore_eos=True)
        assert s["total_output_tokens"] == 15 and s["token_check"]["consistent"]
    finally:
        side.stop()
    assert side.proc.exitcode == 0


def test_offline_steps_by_batch_tell_verifies_and_the_plain_step_after_one() -> None:
    # a fake engine: one request at a time, each step one token; steps 2-3 and 6 of each request verify.
    # A plain step right after a verify is a "switch" (no step launched it ahead), the rest "plain"
    from types import SimpleNamespace

    from specserve.bench.offline import run_offline

    class Engine:
        drafter = None

        def __init__(self) -> None:
            self.stats = SimpleNamespace(spec_steps=0)
            self.live: dict[str, int] = {}

        def get_stats(self):
            return SimpleNamespace(k_histogram={})

        def add_request(self, rid, prompt, params) -> None:
            self.live[rid] = 0

        def step(self):
            (rid, n), = self.live.items()
            self.live[rid] = n + 1
            self.stats.spec_steps += n in (1, 2, 5)
            done = n + 1 == 8
            if done:
                del self.live[rid]
            return [SimpleNamespace(request_id=rid, new_token_ids=[7], finished=done, prompt_token_ids=[1, 2],
                                    outputs=[SimpleNamespace(finish_reason="length")],
                                    metrics=SimpleNamespace(spec_verify_steps=0, spec_draft_tokens=0,
                                                            spec_accepted_tokens=0))]

    results, _, steps = run_offline(Engine(), [[1, 2], [3, 4]], [8, 8], concurrency=1, ignore_eos=True)
    assert [sum(r.chunk_tokens) for r in results] == [8, 8]
    kinds = steps.by_batch[1]
    assert {k: v[0] for k, v in kinds.items()} == {"plain": 2 * 3, "verify": 2 * 3, "switch": 2 * 2}
    assert sum(v[2] for v in kinds.values()) == 16


def test_offline_steps_add_up_rounds_and_their_draft_depths() -> None:
    from specserve.bench.offline import StepStats
    from specserve.bench.served_vs_offline import _offline_steps, by_batch_lines

    change = {"turn": 7, "batch": 64, "from": 5, "to": 0}
    table = {"table": {64: {"pick": 0}}, "budget": {}, "pick_changes": [change]}
    got = _offline_steps([StepStats(10, 8, 2.0, {0: 6, 5: 2}, {"fused": 3, "unfused:k": 1}, 2,
                                    {64: {"plain": [6, 0.01, 384], "verify": [2, 0.01, 300]}},
                                    {"table": {}, "pick_changes": [change | {"turn": 3, "from": 0, "to": 5}]}),
                          StepStats(6, 4, 5.0, {5: 4}, {"fused": 4}, 1, {64: {"verify": [4, 0.02, 700]},
                                                                          8: {"plain": [2, 0.002, 16]}}, table)])
    assert got == {"steps": 16, "steady_steps": 12, "mean_step_ms": 3.0, "k_counts": {0: 6, 5: 6}, "mean_k": 2.5,
                   "path_counts": {"fused": 7, "unfused:k": 1}, "explorations": 3,
                   "by_batch": {8: {"plain": {"steps": 2, "seconds": 0.002, "tokens": 16}},
                                64: {"plain": {"steps": 6, "seconds": 0.01, "tokens": 384},
                                     "verify": {"steps": 6, "seconds": 0.03, "tokens": 1000}}},
                   "goodput_table": table | {"pick_changes": [  # the last round's table, every round's changes
                       change | {"turn": 3, "from": 0, "to": 5, "round": 0}, change | {"round": 1}]}}
    plain = _offline_steps([StepStats(3, 2, 1.0)])
    assert plain["k_counts"] is None and plain["mean_k"] is None and plain["path_counts"] is None
    assert plain["by_batch"] is None and plain["goodput_table"] is None
    # printed for no-spec and the adaptive engines, largest batch first; a static chain's left out
    runs = [{"config": name, "concurrency": 64, "offline": got} for name in ("chain6", "adaptive")]
    assert by_batch_lines({"runs": runs}).splitlines()[1:] == [
        "C=64 adaptive: 64 plain 6 x 1.67 verify 6 x 5.00 | 8 plain 2 x 1.00"]
    assert by_batch_lines({"runs": runs[:1]}) == ""


def test_served_vs_offline_configs_and_adaptive_over_the_best_fixed() -> None:
    """Configuration names map to speculative settings (bad ones are refused), and per concurrency the
    adaptive engine is compared with the fastest fixed configuration of that side."""
    from specserve.bench.served_vs_offline import spec_for, versus_best, versus_best_table

    assert spec_for("no-spec") is None
    assert spec_for("adaptive") == {"policy": "adaptive"}
    assert spec_for("chain7") == {"num_steps": 7, "eagle_topk": 1, "policy": "static"}
    assert spec_for("tree") == {"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 16, "policy": "static"}
    assert spec_for("tree8")["num_draft_tokens"] == 8
    assert spec_for("adaptive5") == {"policy": "adaptive", "num_steps": 5}
    for bad in ("chain", "chain0", "chainx", "spec", "tree-2", "adaptive0", "adaptivex", "chain6:clip=1.5"):
        with pytest.raises(ValueError, match="unknown config"):
            spec_for(bad)
    assert spec_for("adaptive:clip=1.5") == {"policy": "adaptive", "adaptive": {"clip": 1.5}}
    assert spec_for("adaptive6:warm_every=2+margin=0.01") == {"policy": "adaptive", "num_steps": 6,
                                                             "adaptive": {"warm_every": 2, "margin": 0.01}}
    for bad, why in (("adaptive:clipp=1.5", "unknown key"), ("adaptive:clip=x", "field=number"),
                     ("adaptive:warm_every=0", "warm_every")):
        with pytest.raises(ValueError, match=why):
            spec_for(bad)

    def run(name: str, c: int, tok_s: float) -> dict:
        return {"config": name, "concurrency": c, "offline": {"output_throughput": tok_s}}

    runs = [run("no-spec", 1, 100.0), run("chain5", 1, 200.0), run("adaptive", 1, 190.0),
            run("no-spec", 64, 400.0), run("chain5", 64, 300.0), run("adaptive", 64, 404.0),
            run("adaptive5", 64, 500.0)]  # a variant of the adaptive engine, never the best fixed one
    vb = versus_best(runs, "offline")
    assert [(v["concurrency"], v["best_fixed"]) for v in vb] == [(1, "chain5"), (64, "no-spec")]
    assert vb[0]["adaptive_over_best"] == pytest.approx(0.95) and vb[1]["adaptive_over_best"] == pytest.approx(1.01)
    assert vb[0]["over_no_spec"]["chain5"] == pytest.approx(2.0)
    table = versus_best_table({"sides": ["offline"], "configs": ["no-spec", "chain5", "adaptive"], "runs": runs,
                               "versus_best": {"offline": vb}})
    assert "| 1 | 100 (1.00x) | 200 (2.00x) | 190 (1.90x) | 0.950 (chain5) | - |" in table
    assert versus_best(runs[:2], "offline") == []  # no adaptive engine: nothing to compare


def test_offline_only_runs_every_configuration_in_turn_the_order_rotating(tmp_path: Path, monkeypatch) -> None:
    """--sides offline: each configuration's engine is started once, then every round of every concurrency runs
    all of them in turn, the first one rotating; each configuration's tok/s comes from its own runs only."""
    import argparse

    from specserve.bench import served_vs_offline as svo
    from specserve.bench.offline import StepStats

    calls: list[tuple[str, int, int]] = []
    speed = {"no-spec": 100.0, "chain5": 180.0, "adaptive": 171.0}  # tokens per second of each engine
    slow_run = 2  # the adaptive engine's second run (C = 1, round 1) at half its speed

    class FakeSide:
        def __init__(self, config, reserved_cores):
            self.name = config
            self.started = True

        def wait_ready(self):
            return {"pid": 1, "device": "cpu", "dtype": "float32", "model": "m", "torch": "t", "cpu_threads": 1, "calibration": None,
                    "tokenizer": type("Tok", (), {"encode": staticmethod(lambda t: t.split())})()}

        def run(self, prompts, max_tokens, concurrency, ignore_eos=False):
            calls.append((self.name, concurrency, len(prompts)))
            v = speed[self.name] / (2 if [c[0] for c in calls].count("adaptive") == slow_run and
                                    self.name == "adaptive" else 1)
            results = []
            for i, n in enumerate(max_tokens):
                r = RequestResult(index=i, expected_output_len=n, client_prompt_len=2, success=True,
                                  start=0.0, ttft=0.01, latency=n / speed[self.name])
                r.chunk_times, r.chunk_tokens = [0.01 * (j + 1) for j in range(n)], [1] * n
                r.usage = {"prompt_tokens": 2, "completion_tokens": n}
                results.append(r)
            return results, sum(max_tokens) / v / concurrency, StepStats(len(max_tokens), 0, None)

        def stop(self):
            self.started = False

    monkeypatch.setattr(svo, "OfflineProcess", FakeSide)
    monkeypatch.setattr(svo, "load_requests", lambda args, tok: [BenchRequest(f"p {i}", 10, 2) for i in range(8)])
    args = argparse.Namespace(api_server_count=1, warmup=0, rounds=2, ignore_eos=True, prompts_per_concurrency=2,
                              min_prompts=4, max_requests=64)
    result = {"start_up": {}, "runs": [], "sides": ["offline"], "configs": list(speed)}
    svo.interleaved_offline(args, {n: n for n in speed}, [1, 4], result, tmp_path)
    assert calls == [("no-spec", 1, 2), ("chain5", 1, 2), ("adaptive", 1, 2),  # C = 1, round 0
                     ("chain5", 1, 2), ("adaptive", 1, 2), ("no-spec", 1, 2),  # round 1: the next one first
                     ("chain5", 4, 4), ("adaptive", 4, 4), ("no-spec", 4, 4),
                     ("adaptive", 4, 4), ("no-spec", 4, 4), ("chain5", 4, 4)]
    tok = {(r["config"], r["concurrency"]): r["offline"]["output_throughput"] for r in result["runs"]}
    assert tok[("chain5", 4)] == pytest.approx(4 * 180.0) and tok[("no-spec", 1)] == pytest.approx(100.0)
    rounds = {(r["config"], r["concurrency"]): r["offline"]["rounds_tok_s"] for r in result["runs"]}
    assert rounds[("chain5", 4)] == pytest.approx([720.0, 720.0]) and rounds[("adaptive", 1)] == pytest.approx([171.0, 85.5])
    vb = svo.versus_best(result["runs"], "offline")
    assert [v["best_fixed"] for v in vb] == ["chain5", "chain5"]
    assert vb[0]["adaptive_over_best"] == pytest.approx(171 * 2 / 3 / 180)  # 40 tokens in 20/171 + 20/85.5 s
    assert vb[0]["rounds_adaptive_over_best"] == pytest.approx([0.95, 0.475])  # each round on its own prompts
    assert vb[1]["rounds_adaptive_over_best"] == pytest.approx([0.95, 0.95])
    assert (tmp_path / "served_vs_offline.json").exists()
