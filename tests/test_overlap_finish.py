"""Overlap scheduling with the adaptive policy on the real SmolLM2: a request that ends (stop string,
length) while the next plain step is already launched gets exactly one finished output and none after."""

import random

from specserve import LLM, SamplingParams
from specserve.sampling_params import RequestOutputKind


def test_no_output_after_a_request_finished():
    llm = LLM(dtype="float32", num_kv_blocks=512, max_num_seqs=16, speculative_algorithm="EAGLE3", speculative_policy="adaptive",
              overlap_schedule="on")
    eng, rng = llm.engine, random.Random(0)
    prompts = ["Tell me about cats.", "Write a poem about the sea.", "What is 2+2?", "List three colors.",
               "Explain gravity briefly.", "Say hi."]
    for i in range(24):
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": rng.choice(prompts)}])
        eng.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=rng.randint(3, 30),
                                                     stop=["."] if i % 3 == 0 else None,
                                                     output_kind=RequestOutputKind.DELTA))
    finished, after = [], []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id in finished:
                after.append(o.request_id)
            if o.finished:
                finished.append(o.request_id)
    assert eng.drafter.path_counts["plain_ahead"] > 0  # the launched-ahead path ran
    assert after == []
    assert sorted(finished) == sorted(f"r{i}" for i in range(24))
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
