"""Structured outputs, pure logic on the real SmolLM2 vocabulary: specs, the compile cache, masks along
draft chains and trees, tool calls (grammar, parsing, streaming) and the OpenAI request fields."""

import json
from types import SimpleNamespace

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from specserve.loader import load_model_source  # noqa: E402
from specserve.speculative.tree import DraftTree  # noqa: E402
from specserve.structured.grammar import GrammarCompiler, GrammarError, check  # noqa: E402
from specserve.engine.logits_process import chain_prefixes, process  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402
from specserve.structured.matcher import (GrammarState, GrammarViolation, mask_draft_logits,  # noqa: E402
                                         prefix_tree)
from specserve.structured.openai_fields import FieldError, structured_outputs  # noqa: E402
from specserve.structured.params import StructuredOutputsParams as SO  # noqa: E402
from specserve.structured.tools import (ToolCallStream, ToolError, parse_tool_calls, plan_tools,  # noqa: E402
                                        render_messages)

V = 49152
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return load_model_source(None, require_weights=False).tokenizer


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, V)


def allowed(row: torch.Tensor) -> set[int]:
    bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:V]
    return set(torch.nonzero(bits).flatten().tolist())


def accepts(compiler, spec: SO, tok, text: str) -> bool:
    """Whether the grammar takes ``text`` and then ends (EOS)."""
    m = xgr.GrammarMatcher(compiler.compile(spec))
    return all(m.accept_token(t) for t in tok.encode(text)) and m.accept_token(2) and m.is_terminated()


# ---------------------------------------------------------------- specs and the cache


def test_spec_takes_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        SO(choice=[])
    with pytest.raises(ValueError, match="not valid JSON"):
        SO(json="{nope")
    assert SO.of({"regex": "a+"}).kind == "regex"
    with pytest.raises(ValueError, match="unknown"):
        SO.of({"jsn": {}})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == SO(regex="a+")
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):  # (EOS masked where only EOS fits)
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})


def test_compile_cache_is_keyed_by_the_schema_not_its_key_order(compiler):
    before = compiler.num_compiled
    a = compiler.compile(SO(json=PERSON))
    b = compiler.compile(SO(json=dict(reversed(list(PERSON.items())))))
    c = compiler.compile(SO(json=json.dumps(PERSON, sort_keys=True, separators=(",", ":"))))
    assert a is b is c and compiler.num_compiled == before + 1
    compiler.compile(SO(regex="[0-9]+"))
    assert compiler.num_compiled == before + 2


@pytest.mark.parametrize("spec,msg", [
    (SO(json={"type": "foo"}), "invalid JSON schema: Unsupported type"),
    (SO(json={"type": "integer", "minimum": 5, "maximum": 2}), "invalid JSON schema"),
    (SO(regex="("), "invalid regex: .*parenthesis"),
    (SO(grammar="root ::= x"), "invalid grammar: .*not defined"),
])
def test_bad_grammars_are_clear_errors(compiler, spec, msg):
    with pytest.raises(GrammarError, match=msg):
        check(spec)
    with pytest.raises(GrammarError, match=msg):
        compiler.compile(spec)


def test_grammars_accept_what_they_describe(compiler, tok):
    assert accepts(compiler, SO(json=PERSON), tok, '{"name": "Bob", "age": 7}')
    assert not accepts(compiler, SO(json=PERSON), tok, '{"name": "Bob"}')
    assert accepts(compiler, SO(json_object=True), tok, '{"x": [1, 2]}')
    assert not accepts(compiler, SO(json_object=True), tok, "[1, 2]")
    assert accepts(compiler, SO(choice=["yes", 'say "hi"']), tok, 'say "hi"')
    assert not accepts(compiler, SO(choice=["yes", "no"]), tok, "maybe")
    assert accepts(compiler, SO(regex=r"\d{3}-\d{4}"), tok, "555-1234")


# ---------------------------------------------------------------- masks along drafts


def sequential_rows(compiled, tokens: list[int]) -> list[set[int]]:
    """What may follow each prefix of ``tokens`` (a fresh matcher fed one token at a time)."""
    m = xgr.GrammarMatcher(compiled)
    bm = xgr.allocate_token_bitmask(1, V)
    rows = []
    for i in range(len(tokens) + 1):
        m.fill_next_token_bitmask(bm)
        rows.append(allowed(bm[0]))
        if i < len(tokens) and not m.accept_token(tokens[i]):
            break
    return rows


def test_chain_rows_follow_the_drafts_and_leave_the_state_alone(compiler, tok):
    compiled = compiler.compile(SO(json=PERSON))
    state = GrammarState(compiled, V, "r")
    committed = tok.encode('{"name')
    for t in committed:
        state.accept(t)
    drafts = tok.encode('": "Al", "age')
    bm = xgr.allocate_token_bitmask(len(drafts) + 1, V)
    state.fill(bm, DraftTree.chain(committed[-1], drafts))
    want = sequential_rows(compiled, committed + drafts)[len(committed):]
    assert [allowed(bm[i]) for i in range(len(drafts) + 1)] == want
    assert want[0] != want[1]  # (the rows differ: the test can tell them apart)
    # the committed state is unchanged: the next committed token is judged from it
    again = xgr.allocate_token_bitmask(1, V)
    state.fill(again, DraftTree.chain(0, []))
    assert allowed(again[0]) == want[0]


def test_tree_rows_and_rows_below_a_rejected_draft(compiler, tok):
    state = GrammarState(compiler.submit(SO(choice=["yes", "no"])), V, "r")
    y, n, bad = tok.encode("yes")[0], tok.encode("no")[0], tok.encode("maybe")[0]
    # root -> {yes, maybe, no}; maybe -> yes (below a draft the grammar rejects)
    tree = DraftTree([0, y, bad, n, y], [-1, 0, 0, 0, 2], [0, 1, 1, 1, 2])
    bm = xgr.allocate_token_bitmask(5, V)
    state.fill(bm, tree)
    assert allowed(bm[0]) >= {y, n} and bad not in allowed(bm[0])
    assert allowed(bm[1]) == {2} == allowed(bm[3])  # "yes" / "no" complete the grammar: EOS only
    assert len(allowed(bm[2])) == V == len(allowed(bm[4]))  # never reachable: left open
    with pytest.raises(GrammarViolation):
        state.accept(bad)


def test_prefix_tree():
    t = prefix_tree([[], [5], [5, 6], [7], [5, 8]])
    assert (t.tokens, t.parents, t.depths) == ([0, 5, 6, 7, 8], [-1, 0, 1, 0, 1], [0, 1, 2, 1, 2])
    assert prefix_tree(chain_prefixes([3, 4])).parents == [-1, 0, 1]


def test_the_logits_processor_masks_the_requests_rows(compiler, tok):
    """Through the engine's hook: rows after [], [yes] of a request with committed output "" and a
    free request's row around it are left alone."""
    state = GrammarState(compiler.submit(SO(choice=["yes", "no"])), V, "r")
    y = tok.encode("yes")[0]
    req = SimpleNamespace(request_id="r", params=SamplingParams(temperature=0), prompt_token_ids=[1],
                          output_token_ids=[], num_output_tokens=0, num_prompt_tokens=1, num_pending_tokens=0,
                          logits_processors=[state])
    logits = torch.randn(4, V)
    out = process(logits, [(req, 1, chain_prefixes([y]))], frozenset({2}))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[3], logits[3])
    finite = set(torch.isfinite(out[1]).nonzero().flatten().tolist())
    assert y in finite and len(finite) < 100 and torch.equal(out[1][list(finite)], logits[1][list(finite)])
    assert set(torch.isfinite(out[2]).nonzero().flatten().tolist()) == {2}  # "yes" done: EOS only
    state.accept(y)
    with pytest.raises(RuntimeError, match="has seen 1 of 0"):
        process(logits, [(req, 1, [[]])], frozenset({2}))


def test_drafts_are_proposed_under_the_grammar_and_rolled_back(compiler, tok):
    """mask_draft_logits over a draft vocabulary (here: target ids 0..V-1 reversed) keeps what the grammar
    allows after the drafts so far; end_drafts returns to the committed state."""
    state = GrammarState(compiler.submit(SO(choice=["yes", "no"])), V, "r")
    y, n = tok.encode("yes")[0], tok.encode("no")[0]
    target_ids = torch.arange(V - 1, -1, -1)
    first = xgr.allocate_token_bitmask(1, V)
    state.fill(first, DraftTree.chain(0, []))
    logits = torch.zeros(2, V)
    mask_draft_logits([None, state], logits, target_ids)
    assert torch.equal(logits[0], torch.zeros(V))
    assert set(target_ids[torch.isfinite(logits[1])].tolist()) == allowed(first[0]) >= {y, n}
    state.draft(y)
    logits = torch.zeros(1, V)
    mask_draft_logits([state], logits, target_ids)
    assert set(target_ids[torch.isfinite(logits[0])].tolist()) == {2}  # "yes" done: EOS only
    state.draft(2)
    state.draft(y)  # past the end: no more masks, nothing accepted
    logits = torch.zeros(1, V)
    mask_draft_logits([state], logits, target_ids)
    assert torch.isfinite(logits).all()
    state.end_drafts()
    bm = xgr.allocate_token_bitmask(1, V)
    state.fill(bm, DraftTree.chain(0, []))
    assert allowed(bm[0]) == allowed(first[0])
    state.accept(n)
    assert state.num_accepted == 1


# ---------------------------------------------------------------- tools


def test_tool_plans_validate_their_input():
    assert plan_tools(None) is None
    assert plan_tools([WEATHER]).mode == "auto"
    assert plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}).named == "get_weather"
    for tools, choice, param in [
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools"),
        ([WEATHER, WEATHER], None, "tools"),
        ([{"type": "retrieval"}], None, "tools"),
        (None, "required", "tool_choice"),
    ]:
        with pytest.raises(ToolError) as e:
            plan_tools(tools, choice)
        assert e.value.param == param


def test_tool_choice_grammars(compiler, tok):
    def ok(choice, text, parallel=None):
        return accepts(compiler, plan_tools([WEATHER, ADD], choice, parallel).structured_outputs(), tok, text)

    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert ok("auto", "Hello.") and ok("auto", "Let me check. " + CALL)
    assert not ok("auto", '<tool_call>\n{"name": "get_weather", "arguments": {"town": "x"}}\n</tool_call>')
    assert ok("required", CALL) and ok("required", CALL + "\n" + add)
    assert not ok("required", "Hello.") and not ok("required", "Sure. " + CALL)
    assert not ok("required", CALL + "\n" + add, parallel=False)
    named = {"type": "function", "function": {"name": "add"}}
    assert ok(named, add) and not ok(named, CALL)
    assert plan_tools([WEATHER], "none").structured_outputs() is None


def test_tool_calls_parsed_and_streamed_alike():
    text = "Sure. " + CALL + "\n" + CALL.replace("Paris", "Oslo") + " <tool_call>\n{\"name\": \"get_w"
    content, calls = parse_tool_calls(text)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c["type"] == "function" and c["function"]["name"] == "get_weather" and c["id"].startswith("call_")
               for c in calls)
    assert content.startswith("Sure.") and content.endswith('{"name": "get_w')  # a call cut short stays text
    assert parse_tool_calls("no calls <tool_call> here") == ("no calls <tool_call> here", [])
    for step in (1, 3, 7, len(text)):
        s, got_text, got = ToolCallStream(), "", []
        for i in range(0, len(text), step):
            t, c = s.feed(text[i : i + step])
            assert "<tool_call>" not in t and "<tool" not in t[-6:]
            got_text, got = got_text + t, got + c
        t, c = s.feed("", final=True)
        got_text, got = got_text + t, got + c
        assert [c["index"] for c in got] == [0, 1]
        assert [c["function"] for c in got] == [c["function"] for c in calls]
        assert got_text.replace(" ", "").replace("\n", "") == content.replace(" ", "").replace("\n", "")


def test_tools_rendered_for_a_template_without_them():
    plan = plan_tools([WEATHER], "required")
    msgs = render_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": '{"temp_c": 21}'},
    ], plan)
    assert msgs[0]["role"] == "system" and '"get_weather"' in msgs[0]["content"] and "must call" in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": CALL}
    assert msgs[3] == {"role": "user", "content": '<tool_response>\n{"temp_c": 21}\n</tool_response>'}
    sys_first = render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}], plan)
    assert len(sys_first) == 2 and sys_first[0]["content"].startswith("Be brief.\n\n")


# ---------------------------------------------------------------- request fields


def test_openai_fields():
    schema_rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert structured_outputs({"response_format": schema_rf}) == SO(json=PERSON)
    assert structured_outputs({"response_format": {"type": "json_object"}}) == SO(json_object=True)
    assert structured_outputs({"response_format": {"type": "text"}}) is None
    assert structured_outputs({"guided_choice": ["a", "b"], "guided_regex": None}) == SO(choice=["a", "b"])
    assert structured_outputs({"structured_outputs": {"regex": "a+"}}) == SO(regex="a+")
    for bad, param in [({"guided_json": {}, "guided_regex": "a"}, "guided_regex"),
                       ({"response_format": {"type": "xml"}}, "response_format"),
                       ({"guided_choice": []}, "guided_choice"),
                       ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs")]:
        with pytest.raises(FieldError) as e:
            structured_outputs(bad)
        assert e.value.param == param
