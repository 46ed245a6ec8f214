"""Structured outputs: grammars (xgrammar) that constrain a request's tokens, in plain and speculative
steps alike, and OpenAI tool calls built on them.

    params.py   what a request asks for (StructuredOutputsParams: json schema, regex, choice, ...)
    grammar.py  spec -> grammar: the front-end's check (400s) and the engine's compile cache
    matcher.py  a request's grammar state (committed tokens) and the masks of a step's rows
    tools.py    tools in the prompt, tool_choice -> grammar, tool calls parsed from the text
    openai.py   OpenAI / vLLM request fields (response_format, guided_*) -> StructuredOutputsParams
"""

from specserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
