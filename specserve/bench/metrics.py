"""Per-request results, the summary the benchmark reports, and server-side metric scraping.

Definitions follow SGLang's and vLLM's serving clients:
- TTFT: request sent -> first chunk that carries generated text.
- ITL: gaps between successive text-carrying chunks (one chunk may hold several tokens when
  the server commits several per step, as speculative decoding does).
- TPOT: per request, (e2e latency - TTFT) / (output tokens - 1); requests with one token skip it.
- E2E latency: request sent -> end of stream.
- Output tokens: the server's ``usage.completion_tokens``; the stream's own token count
  (per-chunk ``token_ids`` or logprobs, when the server sends them) and a re-tokenized count of
  the received text are kept next to it for the consistency check.
- Accept length: generated tokens per verify step, (accepted + verify steps) / verify steps,
  from the usage extension fields summed over requests; the server's own figure from
  /get_server_info; and the same ratio from /metrics counter deltas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (("mean", None), ("median", 50), ("p90", 90), ("p99", 99))
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e_latency")


@dataclass
class RequestResult:
    index: int
    expected_output_len: int
    client_prompt_len: int | None = None
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter when sent
    ttft: float | None = None
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each text chunk
    chunk_tokens: list[int | None] = field(default_factory=list)  # tokens in that chunk, if the stream says
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    retokenized_len: int | None = None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def prompt_len(self) -> int:
        if self.usage and isinstance(self.usage.get("prompt_tokens"), int):
            return self.usage["prompt_tokens"]
        return self.client_prompt_len or 0

    @property
    def stream_tokens(self) -> int | None:
        """Tokens the stream itself reported chunk by chunk; None if any chunk did not say."""
        if not self.chunk_tokens or any(n is None for n in self.chunk_tokens):
            return None
        return sum(self.chunk_tokens)  # type: ignore[arg-type]

    @property
    def usage_output_len(self) -> int | None:
        v = (self.usage or {}).get("completion_tokens")
        return v if isinstance(v, int) else None

    @property
    def output_len(self) -> int:
        for v in (self.usage_output_len, self.stream_tokens, self.retokenized_len):
            if v is not None:
                return v
        return len(self.chunk_times)

    @property
    def output_len_source(self) -> str:
        if self.usage_output_len is not None:
            return "usage"
        if self.stream_tokens is not None:
            return "stream"
        if self.retokenized_len is not None:
            return "retokenized"
        return "chunks"

    @property
    def tpot(self) -> float | None:
        n = self.output_len
        if self.ttft is None or n < 2:
            return None
        return (self.latency - self.ttft) / (n - 1)

    def spec(self, key: str) -> int | None:
        v = (self.usage or {}).get(key)
        return v if isinstance(v, int) else None

    def token_times(self) -> list[tuple[float, float]]:
        """(time, tokens) per text chunk; when the stream does not say how many tokens a chunk
        holds, the request's output tokens are spread evenly over its chunks."""
        if not self.chunk_times:
            return []
        if self.stream_tokens is not None:
            return [(t, float(n)) for t, n in zip(self.chunk_times, self.chunk_tokens)]  # type: ignore[misc]
        each = self.output_len / len(self.chunk_times)
        return [(t, each) for t in self.chunk_times]

    def to_json(self, t0: float, with_text: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "index": self.index,
            "success": self.success,
            "error": self.error,
            "start_s": self.start - t0,
            "prompt_len": self.prompt_len,
            "expected_output_len": self.expected_output_len,
            "output_len": self.output_len,
            "output_len_source": self.output_len_source,
            "stream_tokens": self.stream_tokens,
            "retokenized_len": self.retokenized_len,
            "chunks": len(self.chunk_times),
            "ttft_ms": None if self.ttft is None else self.ttft * 1e3,
            "tpot_ms": None if self.tpot is None else self.tpot * 1e3,
            "e2e_latency_ms": self.latency * 1e3,
            "itl_ms": [x * 1e3 for x in self.itl],
            "finish_reason": self.finish_reason,
            "usage": self.usage,
        }
        if with_text:
            d["text"] = self.text
        return d


def latency_stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    """mean / median / p90 / p99 in milliseconds, keyed like SGLang's JSON (``mean_ttft_ms``)."""
    out: dict[str, float | None] = {}
    arr = np.asarray(values_s, dtype=np.float64) * 1e3
    for label, q in PERCENTILES:
        if arr.size == 0:
            out[f"{label}_{name}_ms"] = None
        elif q is None:
            out[f"{label}_{name}_ms"] = float(arr.mean())
        else:
            out[f"{label}_{name}_ms"] = float(np.percentile(arr, q))
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(results: list[RequestResult], duration: float, ignore_eos: bool) -> dict[str, Any]:
    """The headline numbers of one benchmark run (no server-side data; see serving.py)."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    d: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": _ratio(len(ok), duration),
        "input_throughput": _ratio(in_tokens, duration),
        "output_throughput": _ratio(out_tokens, duration),
        "total_token_throughput": _ratio(in_tokens + out_tokens, duration),
        # average requests in flight (Little's law over the run)
        "concurrency": _ratio(sum(r.latency for r in ok), duration),
    }
    d.update(latency_stats("ttft", [r.ttft for r in ok if r.ttft is not None]))
    d.update(latency_stats("tpot", [t for r in ok if (t := r.tpot) is not None]))
    d.update(latency_stats("itl", [x for r in ok for x in r.itl]))
    d.update(latency_stats("e2e_latency", [r.latency for r in ok]))
    d["token_check"] = token_check(ok, ignore_eos)
    d["spec_usage"] = spec_from_usage(ok)
    return d


def token_check(ok: list[RequestResult], ignore_eos: bool) -> dict[str, Any]:
    """Tokens counted (what the summary uses) against tokens received (what the stream carried)."""
    counted = sum(r.output_len for r in ok)
    usage = [r.usage_output_len for r in ok]
    stream = [r.stream_tokens for r in ok]
    retok = [r.retokenized_len for r in ok]
    # a text chunk carries at least one token, so more chunks than tokens means a miscount
    chunk_overflow = sum(1 for r in ok if len(r.chunk_times) > r.output_len)
    no_usage = sum(1 for u in usage if u is None)
    stream_mismatch = sum(1 for u, s in zip(usage, stream) if u is not None and s is not None and u != s)
    length_mismatch = sum(1 for r in ok if r.output_len != r.expected_output_len) if ignore_eos else None
    consistent = chunk_overflow == 0 and stream_mismatch == 0 and not length_mismatch
    return {
        "tokens_counted": counted,
        "usage_tokens": None if no_usage else sum(u for u in usage if u is not None),
        "stream_tokens": None if any(s is None for s in stream) else sum(s for s in stream if s is not None),
        "retokenized_tokens": None if any(x is None for x in retok) else sum(x for x in retok if x is not None),
        "requests_without_usage": no_usage,
        "stream_usage_mismatches": stream_mismatch,
        "chunks_exceeding_tokens": chunk_overflow,
        "expected_length_mismatches": length_mismatch,
        "consistent": consistent,
    }


def spec_from_usage(ok: list[RequestResult]) -> dict[str, Any]:
    steps = [r.spec("spec_verify_steps") for r in ok]
    acc = [r.spec("spec_accepted_tokens") for r in ok]
    draft = [r.spec("spec_draft_tokens") for r in ok]
    have = [s is not None for s in steps]
    steps_sum = sum(s for s in steps if s is not None)
    acc_sum = sum(a for a in acc if a is not None)
    draft_sum = sum(x for x in draft if x is not None)
    return {
        "requests_with_spec_usage": sum(have),
        "verify_steps": steps_sum,
        "accepted_tokens": acc_sum,
        "draft_tokens": draft_sum,
        "accept_length": _ratio(acc_sum + steps_sum, steps_sum),
        "acceptance_rate": _ratio(acc_sum, draft_sum),
    }


# ---------------------------------------------------------------------------------------------
# /get_server_info and /metrics


def server_info_accept_length(info: dict[str, Any] | None) -> float | None:
    """SGLang puts it at the top level (older) or in ``internal_states[0]`` (newer); read both."""
    if not isinstance(info, dict):
        return None
    v = info.get("avg_spec_accept_length")
    if v is None:
        states = info.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], dict):
            v = states[0].get("avg_spec_accept_length")
    return float(v) if isinstance(v, (int, float)) else None


def parse_prometheus(text: str) -> dict[str, tuple[str, float]]:
    """``{'name{label="v",...}': (family type, value)}`` for every sample in a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, tuple[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue  # creation timestamps, not measurements
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = (fam.type, float(s.value))
    return out


def metrics_delta(before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]) -> dict[str, float]:
    """Counter and histogram samples: after - before; gauges: the value after."""
    out: dict[str, float] = {}
    for key, (typ, v) in after.items():
        if typ in ("counter", "histogram", "summary"):
            out[key] = v - before.get(key, (typ, 0.0))[1]
        else:
            out[key] = v
    return out


def _split(key: str) -> tuple[str, str]:
    i = key.find("{")
    return (key, "") if i < 0 else (key[:i], key[i:])


# Name patterns (regex over the sample name) for the speculation series a server exports;
# specserve's own names (server/metrics.py) are ``specserve:spec_verify_steps_total`` etc.
# Per-position series (a "pos"/"position" label) are left out of the totals.
SPEC_K_HIST = re.compile(r"spec\w*?(k_chosen|chosen_k|draft_k|num_draft_tokens_per_step|draft_len(gth)?)$")
SPEC_K_COUNTER = re.compile(r"spec\w*?(k_chosen|chosen_k)(_total)?$")  # one series per k="n" label
SPEC_ACCEPTED = re.compile(r"spec\w*accepted\w*tokens(_total)?$")
SPEC_VERIFY = re.compile(r"spec\w*(verify_steps|num_drafts)(_total)?$")
SPEC_DRAFT = re.compile(r"spec\w*draft_tokens(_total)?$")
SPEC_STEPS = re.compile(r"\bspec_steps(_total)?$")  # engine steps that speculated
ENGINE_STEPS = re.compile(r"engine_steps(_total)?$")
SPEC_ACCEPT_GAUGE = re.compile(r"spec\w*accept_len(gth)?$")
SPEC_SWITCHES = re.compile(r"spec\w*switch\w*(_total)?$")
_POS_LABEL = re.compile(r"[{,]pos\w*=")
_K_LABEL = re.compile(r'[{,]k="(\d+)"')


def _sum_matching(delta: dict[str, float], pattern: re.Pattern[str], suffix: str = "") -> float | None:
    total, found = 0.0, False
    for key, v in delta.items():
        name, labels = _split(key)
        if suffix:
            if not name.endswith(suffix):
                continue
            name = name[: -len(suffix)]
        if _POS_LABEL.search(labels):
            continue
        if pattern.search(name):
            total += v
            found = True
    return total if found else None


def _k_counts(delta: dict[str, float]) -> dict[int, float]:
    """k -> how often it was chosen, from a counter labelled by k (specserve's spec_k_chosen)."""
    out: dict[int, float] = {}
    for key, v in delta.items():
        name, labels = _split(key)
        m = _K_LABEL.search(labels)
        if m and SPEC_K_COUNTER.search(name):
            out[int(m.group(1))] = out.get(int(m.group(1)), 0.0) + v
    return out


def spec_from_metrics(delta: dict[str, float] | None) -> dict[str, Any]:
    """Mean k, accept length, acceptance rate and share of steps speculating from /metrics
    deltas over a run or a window."""
    keys = ("mean_k", "k_counts", "k0_share", "accept_length", "acceptance_rate", "spec_step_share", "switches")
    if not delta:
        return {k: None for k in keys}
    k_counts = _k_counts(delta)
    n_k = sum(k_counts.values())
    if n_k:
        mean_k = sum(k * n for k, n in k_counts.items()) / n_k
    else:  # a histogram of k per step
        k_sum = _sum_matching(delta, SPEC_K_HIST, "_sum")
        k_cnt = _sum_matching(delta, SPEC_K_HIST, "_count")
        mean_k = _ratio(k_sum, k_cnt) if k_sum is not None and k_cnt else None
    acc = _sum_matching(delta, SPEC_ACCEPTED)
    steps = _sum_matching(delta, SPEC_VERIFY)
    draft = _sum_matching(delta, SPEC_DRAFT)
    spec_steps = _sum_matching(delta, SPEC_STEPS)
    engine_steps = _sum_matching(delta, ENGINE_STEPS)
    accept_len = _ratio(acc + steps, steps) if acc is not None and steps else None
    if accept_len is None and steps is None:  # no counters: a lifetime gauge is all there is
        accept_len = _sum_matching(delta, SPEC_ACCEPT_GAUGE)
    return {
        "mean_k": mean_k,
        "k_counts": {str(k): n for k, n in sorted(k_counts.items()) if n} or None,
        "k0_share": _ratio(k_counts.get(0, 0.0), n_k) if n_k else None,
        "accept_length": accept_len,
        "acceptance_rate": _ratio(acc, draft) if acc is not None and draft else None,
        "spec_step_share": _ratio(spec_steps, engine_steps) if spec_steps is not None and engine_steps else None,
        "switches": _sum_matching(delta, SPEC_SWITCHES),
    }


def spec_series(delta: dict[str, float]) -> dict[str, float]:
    """The speculation-related samples of a delta (names containing 'spec'), for the JSON."""
    return {k: v for k, v in delta.items() if "spec" in _split(k)[0]}
