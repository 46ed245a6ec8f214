"""The soak benchmark's logic against the fake engine: a small mix passes every check, and a server
that leaks KV blocks fails the one that should catch it."""

from __future__ import annotations

import asyncio
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402

from specserve.bench.soak import MALFORMED, SoakConfig, make_plans, run_soak  # noqa: E402
from specserve.server.launch import serve_in_thread  # noqa: E402

LIMIT = 32 * 1024


class LeakyEngine(FakeEngine):
    """Forgets to free the blocks of requests its clients abort."""

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.leaked = getattr(self, "leaked", 0) + 1

    def blocks_used(self) -> int:
        return super().blocks_used() + getattr(self, "leaked", 0)


def _cfg(url: str, drain_timeout_s: float = 10) -> SoakConfig:
    # the whole test process is the front-end here (uvicorn in a thread): a loose RSS bound
    return SoakConfig(url=url, num_requests=80, concurrency=12, disconnect_fraction=0.15, malformed_fraction=0.15,
                      structured_fraction=0.1, max_tokens=24, max_request_bytes=LIMIT, check_json=False,
                      max_rss_growth_mb=256, drain_timeout_s=drain_timeout_s)


def test_plans_have_the_asked_mix() -> None:
    plans = make_plans(SoakConfig(num_requests=200, malformed_fraction=0.05, disconnect_fraction=0.1,
                                  structured_fraction=0.05))
    kinds = [p.kind for p in plans]
    assert (kinds.count("malformed"), kinds.count("disconnect"), kinds.count("structured")) == (10, 20, 10)
    assert {p.malformed for p in plans if p.malformed} == {m for m, _ in MALFORMED}


def test_soak_against_the_fake_server_passes_every_check() -> None:
    with serve_in_thread(partial(FakeEngine, step_delay=0.002, max_num_seqs=16), max_request_bytes=LIMIT) as server:
        result = asyncio.run(run_soak(_cfg(server.url)))
    assert result["passed"], {k: result[k] for k in ("checks", "failures", "final_server_state")}
    assert result["kinds"] == {"valid": 48, "disconnect": 12, "malformed": 12, "structured": 8}
    assert result["malformed_4xx"] == 12 and result["malformed_status"]["too_large"] == [413]
    assert result["disconnected_mid_stream"] > 0 and result["valid_completed"] == 48
    assert len(result["rss_mb"]) > 2 and result["server_pids"]


def test_soak_catches_kv_blocks_left_behind() -> None:
    # leaked blocks never drain: the soak waits out its drain timeout (2 s: the fake server's requests are
    # done in milliseconds), and what is left then is blocks alone, no request
    with serve_in_thread(partial(LeakyEngine, step_delay=0.002, max_num_seqs=16), max_request_bytes=LIMIT) as server:
        result = asyncio.run(run_soak(_cfg(server.url, drain_timeout_s=2)))
    assert not result["checks"]["kv_all_free"] and not result["passed"]
    final = result["final_server_state"]
    assert final["num_running"] == 0 and final["num_waiting"] == 0 and final["kv_usage"] > 0
    assert result["checks"]["no_5xx"] and result["checks"]["valid_all_completed"]
