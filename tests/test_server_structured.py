"""Structured outputs and tools through the official openai client, against a live server running the
real SmolLM2 with speculation on (static chains): response_format, vLLM's guided_* extras, a tool-call
round trip (streamed and not) and the 400s for bad schemas and tools."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytest.importorskip("xgrammar")

from test_server import at_once  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_spec_server) -> openai.OpenAI:
    # (conftest: static chains of 3, a 1,024-token context, 64 blocks, 4 sequences; shared with test_server)
    return openai.OpenAI(base_url=smollm2_spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    kw = dict(model="default", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60)
    forced = dict(kw, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    # the call, the same streamed, and required with one call at most, together
    r, chunks, required = at_once(lambda: client.chat.completions.create(**forced),
                                   lambda: list(client.chat.completions.create(**forced, stream=True)),
                                   lambda: client.chat.completions.create(**kw, tool_choice="required",
                                                                          parallel_tool_calls=False))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    assert r.usage.spec_draft_tokens > 0

    # streamed: the same call, in one delta with its index, id and name
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(0, "get_weather", args)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()

    # required, one call at most: a call to one of the tools
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)

    # the result goes back as a tool message; the answer is text (auto: the model may call again or not)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [choice.message.tool_calls[0].model_dump()]},
                     {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id,
                      "content": json.dumps({"temperature": 21, "unit": "celsius"})}]
    r, none = at_once(lambda: client.chat.completions.create(model="default", messages=history, tools=TOOLS,
                                                              temperature=0, max_tokens=12),
                       lambda: client.chat.completions.create(model="default", messages=history, tools=TOOLS,
                                                              tool_choice="none", temperature=0, max_tokens=8))
    msg = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls") and (msg.content or msg.tool_calls)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_response_format_and_guided_extras(client: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    schema = dict(model="default", messages=ASK, response_format=rf, temperature=0, max_tokens=40)
    r, chunks, obj, choice, regex = at_once(
        lambda: client.chat.completions.create(**schema),
        lambda: list(client.chat.completions.create(**schema, stream=True)),
        lambda: client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Describe a dog in JSON."}],
                                               response_format={"type": "json_object"}, temperature=0.7, seed=3, max_tokens=24),
        lambda: client.completions.create(model="default", prompt="The capital of France is", max_tokens=8, temperature=0,
                                          extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]}),
        lambda: client.chat.completions.create(model="default", messages=ASK, max_tokens=12, temperature=0,
                                               extra_body={"guided_regex": "[0-9]{2} degrees"}))
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: what there is starts an object
        assert obj.choices[0].message.content.startswith("{")
    assert choice.choices[0].text in ("Paris", "Lyon", "Nice") and choice.choices[0].finish_reason == "stop"
    assert regex.choices[0].message.content[:2].isdigit() and regex.choices[0].message.content.endswith(" degrees")


@pytest.mark.parametrize("kw,words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "invalid JSON schema: Unsupported type"),
    (dict(extra_body={"guided_regex": "("}), "invalid regex"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "at most one"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "function.name"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "fixes the output"),
])
def test_bad_structured_requests_are_400(client: openai.OpenAI, kw: dict, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK, max_tokens=4, **kw)
    assert words in str(e.value)
