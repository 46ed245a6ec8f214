"""OpenAI tools: validated, described to the model, enforced by a grammar, parsed back into tool_calls.

One output format for every tool_choice (the Hermes / Qwen style most chat models are tuned on):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

tool_choice -> grammar (an xgrammar structural tag; the arguments follow the tool's JSON schema):
  none      tools left out of the prompt, no grammar, nothing parsed
  auto      free text; once "<tool_call>" starts, a whole call to one of the tools
  required  one or more calls, nothing else (one with parallel_tool_calls false)
  named     exactly one call to that function
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specserve.structured.params import StructuredOutputsParams

BEGIN, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(re.escape(BEGIN) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)


class ToolError(ValueError):
    """Bad tools / tool_choice (a 400); ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of the arguments object


@dataclass(frozen=True)
class ToolPlan:
    tools: list[Tool]
    mode: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function of a named tool_choice
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar this tool_choice puts on the output (None for "none")."""
        if not self.active:
            return None
        tools = [t for t in self.tools if self.mode != "named" or t.name == self.named]
        tags = [{"type": "tag", "begin": f'{BEGIN}\n{{"name": {json.dumps(t.name)}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema": t.parameters, "max_whitespace_cnt": 1}, "end": f"}}\n{END}"}
                for t in tools]
        one = self.mode == "named" or not self.parallel
        if self.mode == "auto":
            fmt = {"type": "triggered_tags", "triggers": [BEGIN], "tags": tags, "stop_after_first": one}
        else:
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                   "stop_after_first": one}
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})

    def system_prompt(self) -> str:
        """The tools described for a chat template that does not take ``tools`` itself."""
        if self.mode == "named":
            ask = f"You must call the function {self.named}."
        elif self.mode == "required":
            ask = "You must call one or more of these functions."
        else:
            ask = "You may call one or more of these functions to answer the user."
        listed = "\n".join(json.dumps({"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}), "parameters": t.parameters}},
            ensure_ascii=False) for t in self.tools)
        return (f"You have access to these functions, inside <tools></tools> tags:\n<tools>\n{listed}\n</tools>\n"
                f"{ask} For each call, write a JSON object with the function's name and arguments inside "
                f"{BEGIN}{END} tags:\n{BEGIN}\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n{END}")


def plan_tools(tools: list[Any] | None, tool_choice: Any = None, parallel_tool_calls: bool | None = None
               ) -> ToolPlan | None:
    """A request's tools and tool_choice, validated (ToolError otherwise); None without tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools must be a list", "tools")
    parsed: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                            "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}", "tools")
        if any(p.name == name for p in parsed):
            raise ToolError(f"tools[{i}]: the function name {name!r} is used twice", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object"}
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        parsed.append(Tool(name, desc, params))
    choice = "auto" if tool_choice is None else tool_choice
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(named, str):
            raise ToolError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if not any(t.name == named for t in parsed):
            raise ToolError(f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise ToolError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                        "tool_choice")
    return ToolPlan(parsed, choice, named, parallel_tool_calls is not False)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(index: int | None, name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI tool_calls entry (``index`` for a stream's delta)."""
    call = {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
    return call if index is None else {"index": index, **call}


def _decode_call(body: str) -> tuple[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], obj.get("arguments", {})


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output: whole calls become tool_calls, the rest (a call cut
    short too) stays text; content is None when nothing else is left."""
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        got = _decode_call(m.group(1))
        if got is None:
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(tool_call(None, *got))
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _partial_begin(text: str) -> int:
    """Length of the longest tail of ``text`` that begins BEGIN ("... <tool" -> 5)."""
    for k in range(min(len(BEGIN) - 1, len(text)), 0, -1):
        if text.endswith(BEGIN[:k]):
            return k
    return 0


class ToolCallStream:
    """A stream's text -> content deltas and whole tool calls. Text that may begin a call is held back;
    a call is sent in one delta once its END arrives."""

    def __init__(self) -> None:
        self.buf = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool_call deltas to send now)."""
        self.buf += text
        content, calls = [], []
        while True:
            start = self.buf.find(BEGIN)
            if start < 0:
                keep = 0 if final else _partial_begin(self.buf)
                content.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            end = self.buf.find(END, start)
            if end < 0:
                content.append(self.buf[:start])
                self.buf = self.buf[start:]
                if final:  # a call cut short: its text, as the non-streamed parse keeps it
                    content.append(self.buf)
                    self.buf = ""
                break
            got = _decode_call(self.buf[start + len(BEGIN) : end].strip())
            content.append(self.buf[:start])
            if got is None:
                content.append(self.buf[start : end + len(END)])
            else:
                calls.append(tool_call(self.num_calls, *got))
                self.num_calls += 1
            self.buf = self.buf[end + len(END) :]
        return "".join(content), calls


def _call_text(call: Any) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError("an assistant message's tool_calls entries need function.name and function.arguments",
                        "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolError(f"tool call {fn['name']!r}: arguments are not JSON ({e})", "messages") from None
    return f"{BEGIN}\n{json.dumps({'name': fn['name'], 'arguments': args}, ensure_ascii=False)}\n{END}"


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, str]]:
    """Messages for a chat template that knows no tools: the tools in the system message, past tool calls
    in the assistant's text as the model writes them, tool results as <tool_response> user turns. A
    conversation without tools or tool calls goes to the template as it is."""
    if plan is None and not any(m.get("tool_calls") for m in messages):
        return [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            content = "\n".join(([content] if content else []) + [_call_text(c) for c in m["tool_calls"]])
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if plan is not None and plan.active:
        tools_text = plan.system_prompt()
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{tools_text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": tools_text})
    return out
