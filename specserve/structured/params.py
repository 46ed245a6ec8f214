"""What a request constrains its output to (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
schema, any JSON object, a regex, a list of choices, an EBNF grammar or an xgrammar structural tag.

Plain data, importable without torch or xgrammar: it crosses the front-end -> engine-core boundary as a dict.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (dict or its text)
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF-style, root rule ``root``)
    structural_tag: str | dict | None = None  # xgrammar's structural-tag format (tool calls)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(self.json).__name__}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("json_object must be true")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError("structural_tag must be an object or its JSON text")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    def key(self) -> tuple[str, str]:
        """The grammar cache's key: (kind, canonical text), so equal schemas share one compiled grammar."""
        v = self.value
        text = v if isinstance(v, str) else json.dumps(v, sort_keys=True, separators=(",", ":"))
        return self.kind, text

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def of(cls, v: "StructuredOutputsParams | dict | None") -> "StructuredOutputsParams | None":
        """From a params dict (the engine core's side of the boundary) or as given."""
        if v is None or isinstance(v, cls):
            return v
        if not isinstance(v, dict):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(v).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(v) - names
        if unknown:
            raise ValueError(f"unknown structured_outputs fields: {', '.join(sorted(unknown))}")
        return cls(**v)
