"""StructuredOutputs -> llguidance grammars, their bounds and their validation (no tokenizer needed:
the gateway and the processor call `check_grammar` before a request travels; the engine compiles it
for real).

What a constraint may cost, wherever it is read:

    check_bounds      linear in the spec's bytes, nothing parsed recursively, nothing compiled:
                      bytes, choices, JSON nesting depth, regex length, grammar rules (GrammarLimits)
    to_grammar        linear too: a choice list is one lexeme (an alternation of literals), never a
                      rule with one alternative per choice, which llguidance validates in quadratic time
    llguidance        PARSER_LIMITS' fuel ends a lexer or grammar too costly to build, in the
                      validation and in the engine's compile alike

Validation and compile release the GIL: the callers run them on threads, never on an event loop.

Why llguidance and not xgrammar: docs/features/structured_outputs.md (the engine stays free of torch, which
xgrammar imports; llguidance needs only the tokenizer.json, and its masks were correct on this
model's byte-level tokenizer).
"""

from __future__ import annotations

import json
import re

import llguidance

from services.common.config import GrammarLimits, flag_of
from services.common.structured_outputs import StructuredOutputs

# Compact JSON: no free whitespace between tokens. A small model given "any whitespace" may emit
# newlines until max_tokens (vLLM added disable_any_whitespace for that); compact JSON parses the same.
JSON_OPTIONS = {"whitespace_flexible": False}

# llguidance's defaults (its fuel and grammar-size budgets stop a compile that would cost more), with
# terse errors: a verbose one echoes the grammar and parser state back to whoever sent it.
PARSER_LIMITS = {"verbose_errors": False}
MAX_ERROR_CHARS = 500  # of llguidance's reason in a 400: it may quote the spec

# One JSON string (skipped whole: brackets inside it do not nest) or one bracket. One character per
# step inside a string, so a failed match never backtracks more than the string's length.
_JSON_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
# A rule's head at the start of a line: Lark's `name:`, `?name:`, `TERM.2:` or GBNF's `name ::=`.
_GRAMMAR_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?:::=|:)", re.MULTILINE)


class ConstraintTooLarge(ValueError):
    """A constraint over one of GrammarLimits' bounds (its message names the bound's flag)."""


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def json_depth(text: str) -> int:
    """How deeply objects and arrays nest in the JSON `text`, counted without parsing it (so without
    recursion: Python's json module raises RecursionError, not ValueError, past about a thousand)."""
    depth = deepest = 0
    for match in _JSON_NESTING.finditer(text):
        bracket = match.group()
        if bracket in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
        elif bracket in ("]", "}"):
            depth -= 1
    return deepest


def check_bounds(constraint: StructuredOutputs, limits: GrammarLimits) -> None:
    """ConstraintTooLarge naming the flag of the first bound `constraint` is over. Linear in its size."""
    kind, spec = constraint.kind, constraint.spec
    _check("bytes", len(spec.encode()), limits, "max_constraint_bytes")
    if kind in ("json", "choice"):
        _check("levels of nesting", json_depth(spec), limits, "max_constraint_depth")
    if kind == "choice":
        choices = json.loads(spec)  # shallow now: no RecursionError
        if isinstance(choices, list):
            _check("choices", len(choices), limits, "max_constraint_choices")
    elif kind == "regex":
        _check("characters", len(spec), limits, "max_regex_length")
    elif kind == "grammar":
        _check("grammar rules", len(_GRAMMAR_RULE.findall(spec)), limits, "max_grammar_rules")


def _check(what: str, value: int, limits: GrammarLimits, name: str) -> None:
    limit = getattr(limits, name)
    if value > limit:
        raise ConstraintTooLarge(f"{value} {what}, over this server's limit of {limit} "
                                 f"({flag_of(GrammarLimits, name)})")


def to_grammar(constraint: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) of `constraint`. ValueError for a spec that is not even
    well-formed (a schema that is not JSON, a choice list that is not a list of strings)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json":
        schema = json.loads(spec)  # ValueError (JSONDecodeError) for a spec that is no JSON
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be a JSON object")
        closed = json.dumps(closed_schema(schema))  # `schema` is this call's own parse
        return llguidance.LLMatcher.grammar_from_json_schema(closed, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        # One terminal whose regex is the alternation (Lark string literals take JSON's escapes): the
        # same language as a rule of one alternative per choice, validated in linear time, not quadratic.
        return llguidance.LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, choices)))
    assert kind == "grammar", kind
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark


def closed_schema(schema: object) -> object:
    """`schema` compiled strictly, as xgrammar's strict mode (vLLM's default) and OpenAI's strict function
    calling do: an object that lists `properties` takes no other key unless it says so
    (`additionalProperties`), and an array of `prefixItems` no other item unless it says so (`items`).
    Otherwise a model may keep adding keys until max_tokens and its tool call never ends. A bare
    {"type": "object"} stays any object. Changes `schema` in place and returns it; iterative, so any
    depth is safe."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue  # true, false: nothing to close
        if isinstance(node.get("properties"), dict):
            node.setdefault("additionalProperties", False)
        if isinstance(node.get("prefixItems"), list):
            node.setdefault("items", False)
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                stack.extend(value)
            elif key in _SCHEMA_KEYS:
                stack.append(value)
    return schema


# Where a JSON schema holds other schemas: by name, in a list, or as the value.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_KEYS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def checked_grammar(constraint: StructuredOutputs, limits: GrammarLimits) -> str:
    """`constraint`'s grammar once within `limits`; ValueError ("invalid <kind>: why") otherwise."""
    try:
        check_bounds(constraint, limits)
        return to_grammar(constraint)
    except (ValueError, RecursionError) as e:  # RecursionError: a belt; check_bounds bounds the nesting
        raise ValueError(f"invalid {constraint.kind}: {e}") from None


def check_grammar(constraint: StructuredOutputs, limits: GrammarLimits) -> None:
    """ValueError with the bound or llguidance's reason when `constraint` cannot compile (a bad or
    too large schema, regex, grammar). Parses the grammar without a tokenizer, within PARSER_LIMITS;
    seconds at worst within the default bounds, with the GIL released: call it off the event loop."""
    grammar = checked_grammar(constraint, limits)
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise ValueError(f"invalid {constraint.kind}: {error.strip()[:MAX_ERROR_CHARS]}")
