"""A request's output constraint (vLLM's StructuredOutputsParams, one kind at a time): what the engine
compiles into a grammar and enforces token by token (services/engine/structured_output.py).

    StructuredOutputs("json", '{"type": "object", ...}')   the output is JSON valid against the schema
    StructuredOutputs("json_object")                        the output is a JSON object (any)
    StructuredOutputs("regex", "[0-9]{3}")                  the output matches the regex, whole
    StructuredOutputs("choice", '["yes", "no"]')            the output is one of the strings (a JSON list)
    StructuredOutputs("grammar", 'start: "a" | "b"')        the output is in the Lark (or GBNF) grammar

The spec is text, so that a request's constraint is one hashable key of the engine's grammar cache
and crosses the wire as it is. services/common/grammar.py turns it into an llguidance grammar.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    kind: str
    spec: str = ""  # "" for json_object only

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured outputs kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == "json_object") != (not self.spec):
            raise ValueError(f"structured outputs of kind {self.kind!r} "
                             f"{'take no spec' if self.kind == 'json_object' else 'need a spec'}")
