"""Stop strings that span tokens: a stream never shows text that a stop string later cuts.

Streamed (DELTA) text must equal the finished text; the server's front-end uses the same helpers
(its end-to-end check is in test_server.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from specserve.engine.stop import find_stop_string, stop_string_holdback, streamable_text_end
from specserve.sampling_params import RequestOutputKind, SamplingParams

PARIS = [{"role": "user", "content": "Write one sentence about the city of Paris."}]


def test_holdback_is_the_longest_tail_that_begins_a_stop_string() -> None:
    assert stop_string_holdback("Paris is a city that", ["that has"]) == 4
    assert stop_string_holdback("Paris is a city that h", ["that has"]) == 6
    assert stop_string_holdback("Paris is a city tha", ["xyz", "that has"]) == 3
    assert stop_string_holdback("a city t", ["that has", "to"]) == 1
    assert stop_string_holdback("the end", ["that has"]) == 0
    assert stop_string_holdback("ab", ["abc"]) == 2  # the whole text may be held
    assert stop_string_holdback("xabc", ["abc"]) == 0  # a whole stop string is not a beginning of one


def test_streamable_end_and_find() -> None:
    p = SamplingParams(stop=["that has"])
    assert streamable_text_end("a city that", p, finished=False) == len("a city ")
    assert streamable_text_end("a city that", p, finished=True) == len("a city that")
    keep = SamplingParams(stop=["that has"], include_stop_str_in_output=True)
    assert streamable_text_end("a city that", keep, finished=False) == len("a city that")
    assert find_stop_string("a city that has", ["has", "that"], new_text_start=12) == (12, "has")  # list order
    assert find_stop_string("that x that", ["that"], new_text_start=10) == (7, "that")  # ends in the new text
    assert find_stop_string("a city that", ["has"], 0) is None


@pytest.fixture(scope="module")
def engine() -> Iterator:
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    yield LLMEngine(EngineConfig(dtype="float32", max_model_len=128, num_kv_blocks=96, max_num_seqs=32))


def _run(engine, prompt_ids: list[int], runs: dict[str, tuple[RequestOutputKind, dict]]) -> dict[str, list[str]]:
    """All runs as one batch (greedy: batching does not change the tokens); each run's output texts."""
    for rid, (kind, kw) in runs.items():
        engine.add_request(rid, list(prompt_ids), SamplingParams(temperature=0, max_tokens=12, output_kind=kind, **kw))
    texts: dict[str, list[str]] = {rid: [] for rid in runs}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.outputs[0].text)
    return texts


def spanning_stops(pieces: list[str], first: int = 4) -> list[str]:
    """Stop strings that start inside token ``first`` and end inside token first + k - 1, k = 1..4."""
    # drop a character at both ends: cut inside the first and the last token
    return ["".join(pieces[first : first + k])[1:-1] for k in range(1, 5)]


def test_engine_stream_equals_final_text_for_stops_spanning_1_to_4_tokens(engine) -> None:
    ids = engine.tokenizer.apply_chat_template(PARIS, add_generation_prompt=True)
    full = _run(engine, ids, {"full": (RequestOutputKind.FINAL_ONLY, {})})["full"][-1]
    pieces = [engine.tokenizer.decode([t]) for t in engine.tokenizer.encode(full)]
    assert "".join(pieces) == full
    stops = ["that has", *spanning_stops(pieces)]
    runs = {}
    for i, stop in enumerate(stops):
        for include in (False, True):
            kw = dict(stop=[stop], include_stop_str_in_output=include)
            for kind in RequestOutputKind:
                runs[f"{i}-{include}-{kind.name}"] = (kind, kw)
    texts = _run(engine, ids, runs)
    for i, stop in enumerate(stops):
        for include in (False, True):
            at = full.index(stop)
            expected = full[: at + len(stop)] if include else full[:at]
            key = f"{i}-{include}-"
            assert texts[key + "FINAL_ONLY"] == [expected], (stop, include)
            assert "".join(texts[key + "DELTA"]) == expected, (stop, include, texts[key + "DELTA"])
            # a cumulative stream never shows text it later takes back
            cumulative = texts[key + "CUMULATIVE"]
            assert all(b.startswith(a) for a, b in zip(cumulative, cumulative[1:])), cumulative
            assert cumulative[-1] == expected
