"""A request's output constraint, from whichever field asked for it (vLLM's rules), checked here so
that a bad schema, regex or grammar is a 400 naming its field before anything travels.

    response_format      {"type": "json_schema", "json_schema": {"schema": ...}} | {"type": "json_object"}
    structured_outputs   {"json": ...} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | {"json_object": true}
    guided_json, guided_regex, guided_choice, guided_grammar     vLLM's older names of the same
    tool_choice          "required" or a named function: the calls' JSON (services/gateway/tool_calls.py)

At most one field may constrain a request. Its bounds (GrammarLimits) are checked in linear time on
the event loop; llguidance's validation of it runs on a thread, so that a costly grammar never stalls
another request's stream or /health.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, NamedTuple

from services.common.config import GrammarLimits
from services.common.grammar import ConstraintTooLarge, check_bounds, check_grammar
from services.common.structured_outputs import StructuredOutputs
from services.gateway.errors import APIError, bad_request
from services.gateway.protocol import ChatCompletionRequest, SamplingRequest, StructuredOutputsRequest
from services.gateway.tool_calls import tool_choice_of

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class Constraint(NamedTuple):
    field: str  # the request field that asked for it (the 400's param)
    value: StructuredOutputs
    where: str = ""  # where in the field, for messages (structured_outputs.regex); "": the field itself


def structured_outputs_of(body: SamplingRequest, limits: GrammarLimits = GrammarLimits()) -> StructuredOutputs | None:
    """The request's constraint, within `limits`; None when it has none. APIError 400 naming the
    field. Linear in the constraint's size: whether it compiles is validate_structured_outputs'."""
    constraint = _constraint(body, limits)
    if constraint is None:
        return None
    try:
        check_bounds(constraint.value, limits)
    except ConstraintTooLarge as e:
        raise _too_large(f"{constraint.where or constraint.field}: {e}", constraint.field) from None
    return constraint.value


async def validate_structured_outputs(body: SamplingRequest, constraint: StructuredOutputs | None,
                                      limits: GrammarLimits) -> None:
    """APIError 400 naming the field when `constraint` (the body's, as structured_outputs_of read it)
    does not compile. llguidance parses it on a thread, with the GIL released: the event loop serves on."""
    if constraint is None:
        return
    try:
        await asyncio.to_thread(check_grammar, constraint, limits)
    except ValueError as e:
        asked = _constraint(body, limits)
        assert asked is not None and asked.value == constraint, "the body's constraint changed"
        raise bad_request(f"{asked.where or asked.field}: {e}", asked.field) from None


def _constraint(body: SamplingRequest, limits: GrammarLimits) -> Constraint | None:
    asked = _constraints(body, limits)
    if len(asked) > 1:
        raise bad_request(f"only one field may constrain the output; this request sets "
                          f"{', '.join(a.field for a in asked)}", asked[1].field)
    return asked[0] if asked else None


def _constraints(body: SamplingRequest, limits: GrammarLimits) -> list[Constraint]:
    asked: list[Constraint] = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        asked.append(Constraint("response_format", StructuredOutputs("json_object")))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs its json_schema", "response_format")
        schema = response_format.json_schema.schema_
        asked.append(Constraint("response_format", _json({} if schema is None else schema)))  # {}: any JSON
    if body.structured_outputs is not None:
        constraint = _of_structured_outputs(body.structured_outputs, limits)
        asked.append(Constraint("structured_outputs", constraint, f"structured_outputs.{constraint.kind}"))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(body, field)
        if value is not None:
            asked.append(Constraint(field, _structured(kind, value, field, limits)))
    if isinstance(body, ChatCompletionRequest):
        choice = tool_choice_of(body)
        if choice is not None:
            asked.append(Constraint("tool_choice", _json(choice.schema)))
    return asked


def _of_structured_outputs(request: StructuredOutputsRequest, limits: GrammarLimits) -> StructuredOutputs:
    for name in ("whitespace_pattern", "structural_tag"):
        if getattr(request, name) is not None:
            raise bad_request(f"structured_outputs.{name} is not supported", "structured_outputs")
    # disable_additional_properties asks what every JSON schema gets here (grammar.closed_schema).
    values = {"json": request.json_, "regex": request.regex, "choice": request.choice, "grammar": request.grammar,
              "json_object": request.json_object or None}
    given = [kind for kind, value in values.items() if value is not None]
    if len(given) != 1:
        raise bad_request(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                          f"got {', '.join(given) or 'none'}", "structured_outputs")
    kind = given[0]
    return _structured(kind, values[kind], f"structured_outputs.{kind}", limits)


def _structured(kind: str, value: Any, field: str, limits: GrammarLimits) -> StructuredOutputs:
    if kind == "json_object":
        return StructuredOutputs("json_object")
    if kind == "json":
        if isinstance(value, str):
            try:
                check_bounds(StructuredOutputs("json", value), limits)  # its nesting, before json.loads recurses
                value = json.loads(value)
            except ConstraintTooLarge as e:
                raise _too_large(f"{field}: {e}", field.split(".")[0]) from None
            except ValueError as e:
                raise bad_request(f"{field}: the schema is not JSON: {e}", field.split(".")[0]) from None
        return _json(value)
    if kind == "choice":
        if not value or not all(value):
            raise bad_request(f"{field} must be a non-empty list of non-empty strings", field.split(".")[0])
        return StructuredOutputs("choice", json.dumps(value))
    if not value:
        raise bad_request(f"{field} must not be empty", field.split(".")[0])
    return StructuredOutputs(kind, value)


def _too_large(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "limit_exceeded")


def _json(schema: Any) -> StructuredOutputs:
    if schema is True:  # JSON Schema's "anything", which llguidance takes only as {}
        schema = {}
    # Compact, keys in the sender's order (they are the output's order): one schema sent the same way
    # twice is one entry of the engine's grammar cache.
    return StructuredOutputs("json", json.dumps(schema, separators=(",", ":")))
