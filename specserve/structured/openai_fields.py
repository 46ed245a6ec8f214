"""OpenAI and vLLM request fields -> StructuredOutputsParams.

  response_format  {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
                   "strict"}}
  guided_json, guided_regex, guided_choice, guided_grammar   vLLM's extras (chat and completions)
  structured_outputs  vLLM's newer object: {"json" | "regex" | "choice" | "grammar" | "json_object" | ...}
At most one of them per request; tool_choice "required" or a named function brings its own grammar.
"""

from __future__ import annotations

from typing import Any

from specserve.structured.params import StructuredOutputsParams


class FieldError(ValueError):
    """A bad structured-output field (a 400); ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise FieldError("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                         "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str):
        raise FieldError("response_format json_schema needs {'name': ..., 'schema': {...}}", "response_format")
    schema = js.get("schema", js.get("schema_"))  # (some clients send pydantic's alias)
    if schema is None:
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise FieldError("response_format.json_schema.schema must be a JSON schema object", "response_format")
    return StructuredOutputsParams(json=schema)


def structured_outputs(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    """From a request's fields (None or absent: not given); FieldError when bad or more than one is given."""
    given = {k: v for k, v in fields.items() if v is not None}
    if len(given) > 1:
        raise FieldError(f"give at most one of {', '.join(sorted(given))}", sorted(given)[1])
    if not given:
        return None
    name, v = next(iter(given.items()))
    try:
        if name == "response_format":
            return from_response_format(v)
        if name == "structured_outputs":
            return StructuredOutputsParams.of(v)
        if name == "guided_json":
            if not isinstance(v, (dict, str)):
                raise ValueError("guided_json must be a JSON schema (an object or its text)")
            return StructuredOutputsParams(json=v)
        kind = {"guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}[name]
        return StructuredOutputsParams(**{kind: v})
    except FieldError:
        raise
    except (ValueError, TypeError) as e:
        raise FieldError(f"{name}: {e}", name) from None
