"""The server's process tree under signals and failures: `specserve serve` around the fake engine.

SIGTERM drains (503 for new requests, in-flight requests finish or are aborted with a final chunk and
[DONE], exit 0); a killed engine core gives 503s at once and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).parent


class Proc:
    def __init__(self, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, str(HERE / "fake_serve.py"), "--port", str(self.port), "--uvicorn-log-level", "warning",
               *extra]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # its own process group (killpg below)
        self.output = ""
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read()
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self.output = self.proc.stdout.read()
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def server(request) -> Iterator[Proc]:
    p = Proc(*getattr(request, "param", ()))
    yield p
    p.close()


def stream_lines(url: str, body: dict, out: list, first: threading.Event) -> None:
    """Collect a stream's data lines into ``out``; set ``first`` at its first chunk."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line:
                    out.append(line)
                    first.set()
    except httpx.HTTPError as e:
        out.append(e)
    first.set()


def post(url: str, body: dict, out: list) -> None:
    t0 = time.monotonic()
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        out.append((r.status_code, r.json(), time.monotonic() - t0))
    except httpx.HTTPError as e:
        out.append((e, None, time.monotonic() - t0))


def admitted(url: str) -> float:
    """Requests the engine has taken: running now, or finished."""
    n = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(("specserve:num_requests_running", "specserve:request_success_total")):
            n += float(line.split()[-1])
    return n


def start(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("server", [("--shutdown-timeout", "2")], indirect=True)  # (a 40-token stream: ~0.4 s)
@pytest.mark.parametrize("group", [False, True], ids=["server", "process-group"])
def test_sigterm_drains_streams_and_requests_then_exits_zero(server: Proc, group: bool) -> None:
    """SIGTERM to the server, or to its whole process group as systemd and `timeout` send it."""
    body = {"prompt": "x", "temperature": 0}
    streams, threads, firsts = [], [], []
    for i in range(16):  # half finish within the drain, half are still going at its end
        out, first = [], threading.Event()
        streams.append(out)
        firsts.append(first)
        threads.append(start(stream_lines, server.url, {**body, "max_tokens": 40 if i % 2 else 3000}, out, first))
    plain: list = []
    for n in (40, 3000, 40, 3000):
        threads.append(start(post, server.url, {**body, "max_tokens": n}, plain))
    for first in firsts:
        assert first.wait(30)
    deadline = time.monotonic() + 30
    while admitted(server.url) < 20:  # every request is in the engine before the signal
        assert time.monotonic() < deadline
        time.sleep(0.02)
    if group:
        os.killpg(server.proc.pid, signal.SIGTERM)
    else:
        server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    late = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=10)
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    for t in threads:
        t.join(30)
    assert server.wait(30) == 0, server.output
    finishes = []
    for out in streams:
        assert out[0] == 200 and out[-1] == "data: [DONE]", out[-3:]
        chunks = [json.loads(line[6:]) for line in out[1:-1]]
        finishes.append(chunks[-1]["choices"][0]["finish_reason"])
    assert sorted(finishes) == ["abort"] * 8 + ["length"] * 8
    assert sorted((code, r["choices"][0]["finish_reason"]) for code, r, _ in plain) == \
        [(200, "abort"), (200, "abort"), (200, "length"), (200, "length")]
    assert "Traceback" not in server.output and "CancelledError" not in server.output, server.output


def test_engine_core_killed_gives_503_at_once_and_nonzero_exit(server: Proc) -> None:
    pid = httpx.get(server.url + "/get_server_info").json()["engine_core_pid"]
    body = {"prompt": "x", "temperature": 0, "max_tokens": 3000}
    out, first, plain = [], threading.Event(), []
    threads = [start(stream_lines, server.url, body, out, first), start(post, server.url, body, plain)]
    assert first.wait(30)
    time.sleep(0.1)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(10)
    code, resp, _ = plain[0]
    assert code == 503, resp
    assert out[-1] == "data: [DONE]" and "engine" in json.loads(out[-2][6:])["error"]["message"]
    assert time.monotonic() - killed < 1.0
    assert server.wait(15) != 0


@pytest.mark.parametrize("server", [("--api-server-count", "2")], indirect=True)
def test_two_front_ends_share_the_port_and_one_engine_core(server: Proc) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, str]:
        with httpx.Client(timeout=30) as c:  # a connection each: the kernel spreads them over the front-ends
            r = c.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5 + i, "temperature": 0})
            return r.status_code, r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(32)))
    assert all(code == 200 for code, _ in results)
    assert [len(text) for _, text in results] == [5 + i for i in range(32)]
    pids = {httpx.get(server.url + "/get_server_info").json()["engine_core_pid"] for _ in range(8)}
    assert len(pids) == 1
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(6):  # whichever front-end answers, /metrics covers both: every request, engine counters once
        with httpx.Client() as c:
            fams = {f.name: f for f in text_string_to_metric_families(c.get(server.url + "/metrics").text)}
        ok = [s.value for s in fams["specserve:request_success"].samples if s.labels.get("finished_reason") == "length"]
        assert ok == [32]
        assert fams["specserve:generation_tokens"].samples[0].value == sum(5 + i for i in range(32))
        assert fams["specserve:time_to_first_token_seconds"].samples[-2].value == 32  # _count
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0, server.output
