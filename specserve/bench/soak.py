"""`specserve bench soak`: many requests against a running `specserve serve`, some malformed, some
structured (`response_format`), some dropped by their client mid-stream; checks that

- every valid request completes (2xx, a finish reason, `[DONE]` on streams),
- every malformed one gets a 4xx, and nothing gets a 5xx,
- every KV block is free at the end (/get_server_info: nothing running or waiting, kv_usage 0),
- the server's memory (RSS of the engine core and the front-ends, read from /proc: same host) does not
  grow from the end of the warm-up to the end of the run,

and writes the figures to a JSON. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

PROMPTS = [
    "Write one sentence about the city of Paris.",
    "List three uses of a paperclip.",
    "Explain what a hash table is in two sentences.",
    "Give me a short poem about the sea.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Name five animals that live in the desert.",
    "How do I reverse a list in Python?",
    "Describe the colour blue to someone who cannot see.",
    "Why is the sky blue?",
]

# (name, body or raw bytes): each must get a 4xx
MALFORMED: list[tuple[str, Any]] = [
    ("invalid_json", b'{"messages": [{"role": "user", "content": "hi"}'),
    ("string_max_tokens", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}),
    ("string_stream", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}),
    ("no_messages", {"max_tokens": 5}),
    ("unknown_role", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("negative_temperature", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("n_2", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ("unknown_model", {"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}),
    ("too_large", None),  # a body one byte over --max-request-bytes
]


@dataclass
class Outcome:
    kind: str  # valid | disconnect | malformed | structured
    status: int | None = None
    ok: bool = False  # what this kind must do, done
    finish_reason: str | None = None
    detail: str = ""
    seconds: float = 0.0
    tokens: int = 0


@dataclass
class SoakConfig:
    url: str = "http://127.0.0.1:8000"
    num_requests: int = 1000
    concurrency: int = 64
    disconnect_fraction: float = 0.10
    malformed_fraction: float = 0.05
    structured_fraction: float = 0.05
    max_tokens: int = 64
    max_request_bytes: int = 4 << 20
    model: str = "default"
    api_key: str | None = None
    seed: int = 0
    # memory is compared from the end of this share of requests on: a leak grows to the end, while
    # warm-up (kernels for new shapes, allocator pools) levels off (100 requests on the CPU: +145 MB in
    # the first half, +10 MB in the second)
    warmup_fraction: float = 0.5
    max_rss_growth_mb: float = 64.0
    check_json: bool = True  # structured outputs that finished with "stop" must parse as JSON
    timeout_s: float = 600.0
    drain_timeout_s: float = 60.0


@dataclass
class Plan:
    kind: str
    stream: bool
    endpoint: str
    prompt: str
    max_tokens: int
    malformed: str | None = None
    disconnect_after: int = 0


def make_plans(cfg: SoakConfig) -> list[Plan]:
    rng = random.Random(cfg.seed)
    n = cfg.num_requests
    counts = {"disconnect": round(n * cfg.disconnect_fraction), "malformed": round(n * cfg.malformed_fraction),
              "structured": round(n * cfg.structured_fraction)}
    kinds = [k for k, c in counts.items() for _ in range(c)]
    kinds += ["valid"] * (n - len(kinds))
    rng.shuffle(kinds)
    plans, bad = [], 0
    for i, kind in enumerate(kinds):
        prompt = PROMPTS[i % len(PROMPTS)]
        max_tokens = rng.randint(max(1, cfg.max_tokens // 4), cfg.max_tokens)
        if kind == "valid":
            plans.append(Plan(kind, rng.random() < 0.7, rng.choice(["chat", "completions"]), prompt, max_tokens))
        elif kind == "disconnect":
            plans.append(Plan(kind, True, "chat", prompt, max(cfg.max_tokens, 8), disconnect_after=rng.randint(1, 3)))
        elif kind == "structured":
            plans.append(Plan(kind, rng.random() < 0.5, "chat", "Reply with a JSON object describing a cat: "
                              "its name and age.", max(cfg.max_tokens, 32)))
        else:
            plans.append(Plan(kind, False, "chat", prompt, max_tokens, malformed=MALFORMED[bad % len(MALFORMED)][0]))
            bad += 1
    return plans


def _body(plan: Plan, cfg: SoakConfig) -> bytes:
    if plan.malformed is not None:
        raw = dict(MALFORMED)[plan.malformed]
        if raw is None:  # over the body limit, still valid JSON
            filler = "x" * (cfg.max_request_bytes + 1)
            return json.dumps({"messages": [{"role": "user", "content": filler}], "max_tokens": 1}).encode()
        return raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": plan.max_tokens, "stream": plan.stream}
    if plan.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": plan.prompt}]
    else:
        body["prompt"] = plan.prompt
    if plan.kind == "structured":
        body["response_format"] = {"type": "json_object"}
        body["temperature"] = 0
    return json.dumps(body).encode()


async def _run_one(client: httpx.AsyncClient, plan: Plan, cfg: SoakConfig) -> Outcome:
    out = Outcome(plan.kind)
    path = "/v1/chat/completions" if plan.endpoint == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    try:
        if not plan.stream:
            r = await client.post(path, content=_body(plan, cfg))
            out.status = r.status_code
            if r.status_code < 300:
                choice = r.json()["choices"][0]
                out.finish_reason = choice["finish_reason"]
                out.tokens = r.json()["usage"]["completion_tokens"]
                text = choice["message"]["content"] if plan.endpoint == "chat" else choice["text"]
                out.ok, out.detail = _judge(plan, out, text, cfg)
            else:
                out.detail = r.text[:200]
                out.ok = plan.kind == "malformed" and 400 <= r.status_code < 500
            return out
        async with client.stream("POST", path, content=_body(plan, cfg)) as r:
            out.status = r.status_code
            if r.status_code >= 300:
                out.detail = (await r.aread()).decode(errors="replace")[:200]
                return out
            chunks, text, done = 0, [], False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    out.detail = f"error event: {obj['error']}"
                    out.status = 500 if "Internal" in str(obj["error"].get("type")) else 503
                    return out
                if obj.get("choices"):
                    c = obj["choices"][0]
                    piece = c.get("delta", {}).get("content") if plan.endpoint == "chat" else c.get("text")
                    if piece:
                        chunks += 1
                        out.tokens += 1
                        text.append(piece)
                    if c.get("finish_reason"):
                        out.finish_reason = c["finish_reason"]
                if plan.kind == "disconnect" and chunks >= plan.disconnect_after and out.finish_reason is None:
                    out.ok, out.detail = True, f"closed after {chunks} chunks"
                    return out  # leaving the block closes the connection mid-stream
            if not done:
                out.detail = "stream ended without [DONE]"
                return out
            out.ok, out.detail = _judge(plan, out, "".join(text), cfg)
            return out
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        out.detail = f"{type(e).__name__}: {e}"[:200]
        return out
    finally:
        out.seconds = time.perf_counter() - t0


def _judge(plan: Plan, out: Outcome, text: str, cfg: SoakConfig) -> tuple[bool, str]:
    if plan.kind == "malformed":
        return False, f"a malformed request ({plan.malformed}) was answered {out.status}"
    if out.finish_reason not in ("stop", "length"):
        return False, f"finish_reason {out.finish_reason!r}"
    if plan.kind == "structured" and out.finish_reason == "stop":
        try:
            json.loads(text)
        except ValueError:
            return not cfg.check_json, f"not JSON: {text[:80]!r}"
    return True, ""


# ---------------------------------------------------------------- the server's side


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def server_state(client: httpx.AsyncClient) -> dict[str, Any]:
    info = (await client.get("/get_server_info")).json()
    state = info["internal_states"][0]
    return {"num_running": state.get("num_running"), "num_waiting": state.get("num_waiting"),
            "kv_usage": state.get("kv_usage"), "pids": [p for p in (info.get("engine_core_pid"),
                                                                    info.get("front_end_pid")) if p]}


async def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    plans = make_plans(cfg)
    headers = {"content-type": "application/json"}
    if cfg.api_key:
        headers["authorization"] = f"Bearer {cfg.api_key}"
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(base_url=cfg.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        pids: set[int] = set()
        for _ in range(4):  # each answer names its front-end; several front-ends share the port
            pids.update((await server_state(client))["pids"])
        rss: list[tuple[int, float]] = []  # (requests done, MB of all server processes)
        rss_by_pid: dict[int, list[float | None]] = {p: [] for p in sorted(pids)}

        def sample(done: int) -> None:
            vals = [rss_mb(p) for p in sorted(pids)]
            for p, v in zip(sorted(pids), vals):
                rss_by_pid[p].append(v)
            if all(v is not None for v in vals) and vals:
                rss.append((done, sum(vals)))

        sample(0)
        outcomes: list[Outcome | None] = [None] * len(plans)
        next_i, done = 0, 0
        warm_at = int(len(plans) * cfg.warmup_fraction)
        step = max(1, len(plans) // 50)
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal next_i, done
            while next_i < len(plans):
                i = next_i
                next_i += 1
                outcomes[i] = await _run_one(client, plans[i], cfg)
                done += 1
                if done == warm_at or done % step == 0:
                    sample(done)

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        duration = time.perf_counter() - t0
        # the end: nothing running or waiting, every KV block free (the core sends fresh stats on aborts)
        deadline = time.monotonic() + cfg.drain_timeout_s
        final = await server_state(client)
        while (final["num_running"] or final["num_waiting"] or final["kv_usage"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            final = await server_state(client)
        sample(len(plans))
    result = report(cfg, plans, [o for o in outcomes if o is not None], final, rss, warm_at, duration, sorted(pids))
    result["rss_mb_by_pid"] = {str(p): {"start": v[0], "end": v[-1]} for p, v in rss_by_pid.items() if v}
    return result


def report(cfg: SoakConfig, plans: list[Plan], outcomes: list[Outcome], final: dict[str, Any],
           rss: list[tuple[int, float]], warm_at: int, duration: float, pids: list[int]) -> dict[str, Any]:
    by: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by.setdefault(o.kind, []).append(o)

    def count(kind: str, pred: Any) -> int:
        return sum(1 for o in by.get(kind, []) if pred(o))

    five = [asdict(o) for o in outcomes if (o.status or 0) >= 500]
    structured = by.get("structured", [])
    warm = [mb for n, mb in rss if n >= warm_at]
    growth = (warm[-1] - warm[0]) if len(warm) >= 2 else None
    checks = {
        "valid_all_completed": count("valid", lambda o: not o.ok) == 0,
        "disconnects_without_error": count("disconnect", lambda o: not o.ok) == 0,
        "malformed_all_4xx": count("malformed", lambda o: not o.ok) == 0,
        "structured_answered": count("structured", lambda o: not o.ok) == 0,
        "no_5xx": not five,
        "kv_all_free": not final["num_running"] and not final["num_waiting"] and not final["kv_usage"],
        "rss_flat": growth is not None and growth <= cfg.max_rss_growth_mb,
    }
    failures = [asdict(o) for o in outcomes if not o.ok][:20]
    return {
        "config": asdict(cfg),
        "passed": all(checks.values()),
        "checks": checks,
        "duration_s": round(duration, 2),
        "requests": len(outcomes),
        "kinds": {k: len(v) for k, v in by.items()},
        "valid_completed": count("valid", lambda o: o.ok),
        "valid_streamed": sum(1 for p, o in zip(plans, outcomes) if p.kind == "valid" and p.stream),
        "disconnected_mid_stream": count("disconnect", lambda o: o.ok and o.finish_reason is None),
        "malformed_4xx": count("malformed", lambda o: o.status is not None and 400 <= o.status < 500),
        "malformed_status": {m: sorted({o.status for p, o in zip(plans, outcomes) if p.malformed == m}, key=str)
                             for m, _ in MALFORMED},
        "structured_2xx": sum(1 for o in structured if o.status is not None and o.status < 300),
        "structured_4xx": sum(1 for o in structured if o.status is not None and 400 <= o.status < 500),
        "structured_json_ok": sum(1 for o in structured if o.finish_reason == "stop" and not o.detail),
        "structured_not_json": sum(1 for o in structured if o.detail.startswith("not JSON")),
        "structured_finish": {r: sum(1 for o in structured if o.finish_reason == r)
                              for r in sorted({str(o.finish_reason) for o in structured})},
        "status_5xx": five[:20],
        "output_tokens": sum(o.tokens for o in outcomes),
        "latency_s": _percentiles([o.seconds for o in by.get("valid", [])]),
        "final_server_state": {k: v for k, v in final.items() if k != "pids"},
        "server_pids": pids,
        "rss_mb": [(n, round(mb, 1)) for n, mb in rss],
        "rss_growth_after_warmup_mb": None if growth is None else round(growth, 1),
        "failures": failures,
    }


def _percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p99": None, "max": None}
    s = sorted(xs)
    return {"p50": round(s[len(s) // 2], 3), "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))], 3),
            "max": round(s[-1], 3)}


# ---------------------------------------------------------------- command line


def add_soak_args(p: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    p.add_argument("--url", default=d.url, help="the server's base URL (same host: its memory is read from /proc)")
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="requests in all")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight at once")
    p.add_argument("--disconnect-fraction", type=float, default=d.disconnect_fraction,
                   help="share of streams whose client leaves after 1-3 chunks")
    p.add_argument("--malformed-fraction", type=float, default=d.malformed_fraction,
                   help="share of malformed requests (bad JSON, wrong types, unknown model, body over the limit)")
    p.add_argument("--structured-fraction", type=float, default=d.structured_fraction,
                   help="share of chat requests with response_format json_object")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="most tokens per request (drawn per request)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="the server's --max-request-bytes: one malformed kind sends a byte more")
    p.add_argument("--model", default=d.model, help="model id sent")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                   help="bearer key (default: $SPECSERVE_API_KEY)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the request mix")
    p.add_argument("--max-rss-growth-mb", type=float, default=d.max_rss_growth_mb,
                   help="most the server processes' RSS may grow from the warm-up's end to the run's end")
    p.add_argument("--no-check-json", dest="check_json", action="store_false",
                   help="do not require structured outputs that stop to parse as JSON (default: required)")
    p.add_argument("--output", default="benchmarks/results/soak.json", help="JSON report path")


def main(args: argparse.Namespace) -> None:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    fields = set(SoakConfig.__dataclass_fields__)
    cfg = SoakConfig(**{k: v for k, v in vars(args).items() if k in fields})
    result = asyncio.run(run_soak(cfg))
    result["command"] = getattr(args, "argv", None)
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: result[k] for k in ("passed", "checks", "duration_s", "kinds", "valid_completed",
                                      "disconnected_mid_stream", "malformed_4xx", "structured_2xx", "structured_4xx",
                                      "structured_json_ok", "structured_not_json", "structured_finish",
                                      "rss_growth_after_warmup_mb",
                                      "final_server_state")}
    print(json.dumps(summary, indent=1))
    print(f"report: {path}", file=sys.stderr)
    sys.exit(0 if result["passed"] else 1)
