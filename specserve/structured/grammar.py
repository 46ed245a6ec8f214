"""Grammars: a request's structured-output spec -> an xgrammar grammar, checked in the front-end and
compiled against the vocabulary once per spec in the engine (an LRU cache keyed by the spec's text)."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from specserve.structured.params import StructuredOutputsParams


class GrammarError(ValueError):
    """The spec is not a grammar xgrammar can build (bad schema, regex, EBNF): a 400."""


# "[08:20:39] /project/cpp/json_schema_converter.cc:5082: Unsupported type" -> "Unsupported type"
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


def _error(spec: StructuredOutputsParams, e: Exception) -> GrammarError:
    what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice list",
            "structural_tag": "structural tag", "json_object": "JSON grammar"}[spec.kind]
    msg = _CPP_PREFIX.sub("", str(e)).strip() or type(e).__name__
    return GrammarError(f"invalid {what}: {msg}")


def choice_ebnf(choices: list[str]) -> str:
    # ["yes", 'say "hi"'] -> root ::= "yes" | "say \"hi\""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema_text(v: str | dict) -> str:
    return v if isinstance(v, str) else json.dumps(v)


# JSON as a small model writes it well: ", " / ": " separators, no free whitespace runs to loop on
_JSON_OPTS = dict(any_whitespace=False, strict_mode=True)


def build_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar of ``spec``, vocabulary-free (the front-end's check); GrammarError if it is not one."""
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(_schema_text(spec.json), **_JSON_OPTS)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False,
                                                strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.grammar)
        tag = spec.structural_tag
        return xgr.Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / pydantic errors
        raise _error(spec, e) from None


def check(spec: StructuredOutputsParams) -> None:
    """Raise GrammarError where ``spec`` is not a valid grammar (the front-end answers 400)."""
    build_grammar(spec)


def tokenizer_info(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of a ``loader.tokenizer.Tokenizer``: token strings by id, padded to the model's
    vocabulary (ids past the tokenizer's are never allowed), EOS as the stop tokens."""
    backend = tokenizer.backend
    vocab = [""] * vocab_size
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = text
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=sorted(tokenizer.eos_token_ids), add_prefix_space=meta["add_prefix_space"])


class GrammarCompiler:
    """Compiled grammars for one vocabulary, the ``capacity`` most recently used kept by spec. A spec is
    checked at once (GrammarError) and compiled on a worker thread (xgrammar releases the interpreter
    lock): the engine steps on meanwhile, and the request's first masked row waits for it."""

    def __init__(self, tokenizer, vocab_size: int, capacity: int = 256) -> None:
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.capacity = capacity
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.num_compiled = 0  # compilations started (a cache miss each)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec``, as a future; GrammarError now if ``spec`` is no grammar."""
        key = spec.key()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        grammar = build_grammar(spec)
        future = self._pool.submit(self._compile, spec, grammar)
        self.num_compiled += 1
        self._cache[key] = future
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return self.submit(spec).result()

    def _compile(self, spec: StructuredOutputsParams, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as e:
            raise _error(spec, e) from None
