"""Twenty JSON schemas of growing difficulty: flat objects, then nested objects, arrays,
enums, string patterns and lengths, numeric bounds, `anyOf`, `$ref`. Shared by the structured-output
tests (every output must validate) and the grammar backends' benchmark (loadtests/grammar_backends.py).
Each is small enough that a tiny model finishes it within a few dozen tokens."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 12}

JSON_SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("boolean", {"type": "boolean"}),
    ("integer", {"type": "integer", "minimum": 0, "maximum": 999}),
    ("enum", {"enum": ["red", "green", "blue"]}),
    ("flat_object", {"type": "object", "properties": {"name": NAME}, "required": ["name"],
                     "additionalProperties": False}),
    ("two_fields", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 150}},
                    "required": ["name", "age"], "additionalProperties": False}),
    ("bool_and_number", {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                          "score": {"type": "number", "minimum": 0, "maximum": 1}},
                         "required": ["ok", "score"], "additionalProperties": False}),
    ("enum_field", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                    "required": ["color"], "additionalProperties": False}),
    ("const_field", {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}},
                     "required": ["kind", "x"], "additionalProperties": False}),
    ("short_array", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                     "minItems": 1, "maxItems": 3}),
    ("array_field", {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 2}},
                     "required": ["tags"], "additionalProperties": False}),
    ("pattern", {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["zip"], "additionalProperties": False}),
    ("date_pattern", {"type": "object",
                      "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
                      "required": ["date"], "additionalProperties": False}),
    ("nested_object", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": NAME,
                                                  "id": {"type": "integer", "minimum": 1, "maximum": 99999}},
                 "required": ["name", "id"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False}),
    ("array_of_objects", {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x", "y"], "additionalProperties": False}}),
    ("anyof_scalar", {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"},
                                                                           {"type": "boolean"}]}},
                      "required": ["value"], "additionalProperties": False}),
    ("anyof_objects", {"anyOf": [
        {"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1}}, "required": ["circle"],
         "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "integer", "minimum": 1}}, "required": ["square"],
         "additionalProperties": False}]}),
    ("nullable", {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 8}},
                  "required": ["note"], "additionalProperties": False}),
    ("ref", {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"], "additionalProperties": False}),
    ("deep_nesting", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"enum": [1, 2, 3]}}, "required": ["c"],
              "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False}),
    ("person", {"type": "object", "properties": {
        "name": NAME,
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "role": {"enum": ["admin", "user"]},
        "langs": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 2},
        "manager": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"name": NAME},
                                                 "required": ["name"], "additionalProperties": False}]}},
        "required": ["name", "email", "role", "langs", "manager"], "additionalProperties": False}),
]
