"""Structured outputs on the real SmolLM2, speculation off and on (chains and trees): JSON-schema outputs
validate, greedy outputs are the same either way, and a constrained request leaves its batch alone."""

import json

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from specserve import LLM, SamplingParams  # noqa: E402

KV = dict(dtype="float32", num_kv_blocks=96, max_model_len=1024)
STATIC = dict(speculative_algorithm="EAGLE3", speculative_policy="static", speculative_num_steps=3)
TREE = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6)
REVIEW = {"type": "object", "properties": {
    "item": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
    "sentiment": {"enum": ["positive", "neutral", "negative"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["item", "sentiment", "score"], "additionalProperties": False}
REVIEWS = ["a quiet kettle", "shoes that hurt", "a fast laptop", "a cold pizza", "a sunny hotel room",
           "a broken umbrella", "fresh bread", "a slow train", "a funny movie", "a noisy fridge", "a soft pillow",
           "a late parcel", "a bright lamp", "a sad novel", "a cheap phone", "a clean beach", "a rude waiter",
           "a warm coat", "a lost suitcase", "a tasty soup"]


@pytest.fixture(scope="module")
def plain(smollm2):
    return smollm2  # (conftest: plain decoding, KV for 4k tokens)


@pytest.fixture(scope="module")
def chain():
    return LLM(**KV, **STATIC)


def _json_convs():
    return [[{"role": "user", "content": f"Review {r} as JSON."}] for r in REVIEWS]


def _texts(outs):
    return [o.outputs[0].text for o in outs]


def test_json_schema_greedy_same_with_speculation_and_valid(plain, chain):
    convs = _json_convs()[:4]
    sp = SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": REVIEW})
    ref = plain.chat(convs, sp)
    assert len(ref) == 4
    for o in ref:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), REVIEW)
    got = chain.chat(convs, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert chain.engine.get_stats().spec_accepted_tokens > 0
    tree = LLM(**KV, **STATIC, **TREE)  # (two of the four: the chain above takes the four)
    assert [o.outputs[0].token_ids for o in tree.chat(convs[:2], sp)] == [o.outputs[0].token_ids for o in ref[:2]]
    assert tree.engine.get_stats().spec_accepted_tokens > 0


def test_sampled_outputs_follow_the_schema_with_speculation(plain, chain):
    """Seeded: the same tokens with speculation on or off (each draw a function of the seed and the output
    index, on the masked distribution). Unseeded: rejection sampling against the masked target."""
    convs = _json_convs()[:3]
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=32, structured_outputs={"json": REVIEW})
    ref, got = plain.chat(convs, seeded), chain.chat(convs, seeded)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    free = chain.chat(convs, SamplingParams(temperature=1.0, max_tokens=32, structured_outputs={"json": REVIEW}))
    done = [o.outputs[0].text for o in got + free if o.outputs[0].finish_reason == "stop"]
    assert len(done) >= 3
    for text in done:
        jsonschema.validate(json.loads(text), REVIEW)


def test_json_object_regex_and_choice(chain):
    conv = [[{"role": "user", "content": "Describe a dog in JSON with name and age."}]]
    out = chain.chat(conv, SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json_object": True}))
    assert out[0].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(out[0].outputs[0].text), dict)
    q = [[{"role": "user", "content": "Is the sky green? Answer yes or no."}]]
    for choices in (["yes", "no"], ["definitely not", "it depends", "yes"]):
        out = chain.chat(q, SamplingParams(temperature=0, max_tokens=16, structured_outputs={"choice": choices}))
        assert out[0].outputs[0].text in choices and out[0].outputs[0].finish_reason == "stop"
    out = chain.generate("My phone number is", SamplingParams(
        temperature=0, max_tokens=16, structured_outputs={"regex": r" \d{3}-\d{4}"}))
    assert out[0].outputs[0].finish_reason == "stop"
    assert len(out[0].outputs[0].text) == 9 and out[0].outputs[0].text[4] == "-"


def test_a_constrained_request_leaves_its_batch_alone(chain, chat_prompts):
    """The same batch twice, its middle request constrained the second time: the others' tokens match."""
    convs = chat_prompts[5:8]
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = chain.chat(convs, free)
    eng = chain.engine
    ids = [chain.tokenizer.apply_chat_template(c) for c in convs]
    for i, (p, sp) in enumerate(zip(ids, [free, SamplingParams(temperature=0, max_tokens=16,
                                                             structured_outputs={"json": REVIEW}), free])):
        eng.add_request(f"m{i}", p, sp)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done["m0"].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert done["m2"].outputs[0].token_ids == ref[2].outputs[0].token_ids
    assert done["m1"].outputs[0].text.startswith('{"item": ')
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_bad_schema_is_refused_at_add_request(plain):
    with pytest.raises(ValueError, match="invalid JSON schema"):
        plain.generate("x", SamplingParams(structured_outputs={"json": {"type": "foo"}}))
    assert not plain.engine.has_unfinished_requests()
