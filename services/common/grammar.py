"""StructuredOutputs -> llguidance grammars, and their validation (no tokenizer needed: the gateway
and the processor call `check_grammar` before a request travels; the engine compiles it for real).

Why llguidance and not xgrammar: docs/structured_outputs.md (the engine stays free of torch, which
xgrammar imports; llguidance needs only the tokenizer.json, and its masks were correct on this
model's byte-level tokenizer).
"""

from __future__ import annotations

import json

import llguidance

from services.common.structured_outputs import StructuredOutputs

# Compact JSON: no free whitespace between tokens. A small model given "any whitespace" may emit
# newlines until max_tokens (vLLM added disable_any_whitespace for that); compact JSON parses the same.
JSON_OPTIONS = {"whitespace_flexible": False}


def to_grammar(constraint: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) of `constraint`. ValueError for a spec that is not even
    well-formed (a schema that is not JSON, a choice list that is not a list of strings)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json":
        schema = json.loads(spec)  # ValueError (JSONDecodeError) for a spec that is no JSON
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    assert kind == "grammar", kind
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark


def check_grammar(constraint: StructuredOutputs) -> None:
    """ValueError with llguidance's reason when `constraint` cannot compile (a bad schema, regex,
    grammar). Fast: parses the grammar without a tokenizer."""
    try:
        grammar = to_grammar(constraint)
    except ValueError as e:
        raise ValueError(f"invalid {constraint.kind}: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {constraint.kind}: {error.strip()}")
