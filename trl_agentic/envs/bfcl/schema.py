"""Tool functions whose schema, as TRL renders it, is BFCL's official function doc.

TRL shows the model each tool through transformers' `get_json_schema`, which reads a function's signature (type hints,
defaults) and its Google-style docstring. For every official doc (`multi_turn_func_doc/*.json`) we build a function
with exactly that signature and docstring, so the rendered schema has the official name, description, parameter
names, types (BFCL's `dict` -> `object`, `float` -> `number`, the JSON-schema names, as BFCL's own OpenAI-style
conversion does), parameter descriptions and required parameters. Two things of the official docs that
`get_json_schema` cannot express are carried differently: the keys of a `dict` parameter (one parameter,
`TicketAPI.edit_ticket(updates)`) are listed at the end of its description, and parameter defaults (`"default"`) are
not shown (an optional parameter is simply not required). `official_json_schema` is the official doc in the same
JSON-schema form, for comparison.

The function forwards the model's arguments untouched to the API method (`**kwargs`), so a call the model makes is
executed exactly as the official checker executes it.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

# BFCL type names -> Python types (what `get_json_schema` turns back into JSON-schema types).
_PYTHON_TYPES = {
    "string": str,
    "integer": int,
    "float": float,
    "number": float,
    "boolean": bool,
    "dict": dict,
    "object": dict,
    "any": Any,
}

# BFCL type names -> JSON-schema type names (BFCL's GORILLA_TO_OPENAPI for the names these docs use).
_JSON_TYPES = {
    "string": "string",
    "integer": "integer",
    "float": "number",
    "number": "number",
    "boolean": "boolean",
    "dict": "object",
    "object": "object",
    "array": "array",
}


def _python_type(spec: dict):
    kind = spec.get("type", "string")
    if kind in ("array", "list", "tuple"):
        items = spec.get("items")
        return list[_python_type(items)] if items else list
    if kind not in _PYTHON_TYPES:
        raise ValueError(f"Unsupported BFCL parameter type {kind!r}.")
    return _PYTHON_TYPES[kind]


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _parameter_description(spec: dict) -> str:
    description = _one_line(spec.get("description", ""))
    nested = spec.get("properties")
    if nested:  # get_json_schema has no nested properties: name the keys in the description
        keys = "; ".join(
            f"{name} ({_JSON_TYPES.get(sub.get('type', 'string'), 'string')}): {_one_line(sub.get('description', ''))}"
            for name, sub in nested.items()
        )
        description = f"{description} Keys: {keys}"
    return description


def tool_docstring(doc: dict) -> str:
    """The Google-style docstring `get_json_schema` reads back as the doc's description and parameter descriptions."""
    lines = [_one_line(doc["description"])]
    properties = doc["parameters"].get("properties", {})
    if properties:
        lines += ["", "Args:"]
        lines += [f"    {name}: {_parameter_description(spec)}" for name, spec in properties.items()]
    return "\n".join(lines)


def make_tool_function(doc: dict, call: Callable[[Any, str, dict], Any]) -> Callable:
    """
    A function `(self, **kwargs)` named after the doc, with the doc's signature and docstring, that runs
    `call(self, name, kwargs)`. Put it on a class and its bound method is a tool TRL renders with the official schema.

    Args:
        doc (`dict`): An official function doc.
        call (`Callable`): `call(self, name, kwargs) -> result`, the implementation.
    """
    name = doc["name"]
    properties = doc["parameters"].get("properties", {})
    required = list(doc["parameters"].get("required", []))

    def tool(self, **kwargs):
        return call(self, name, kwargs)

    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations = {}
    # Keyword-only, required ones first in the doc's `required` order: get_json_schema lists `required` in signature
    # order, the properties in annotation order (the doc's).
    for param in required + [p for p in properties if p not in required]:
        default = inspect.Parameter.empty if param in required else None
        parameters.append(
            inspect.Parameter(
                param, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=_python_type(properties[param])
            )
        )
    for param, spec in properties.items():  # schema properties in the doc's order
        annotations[param] = _python_type(spec)
    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = tool_docstring(doc)
    tool.__signature__ = inspect.Signature(parameters)
    tool.__annotations__ = annotations
    return tool


def official_json_schema(doc: dict) -> dict:
    """
    The official doc in the JSON-schema form `get_json_schema` produces (`{"type": "function", "function": ...}`):
    types mapped to JSON-schema names, whitespace of descriptions normalised, `default` entries dropped.

    Args:
        doc (`dict`): An official function doc.
    """

    def convert(spec: dict) -> dict:
        out = {"type": _JSON_TYPES[spec.get("type", "string")]}
        if "items" in spec:
            out["items"] = convert(spec["items"])
        if "description" in spec:
            out["description"] = _one_line(spec["description"])
        if "properties" in spec:
            out["properties"] = {k: convert(v) for k, v in spec["properties"].items()}
        return out

    doc = copy.deepcopy(doc)
    properties = doc["parameters"].get("properties", {})
    parameters = {"type": "object", "properties": {k: convert(v) for k, v in properties.items()}}
    if doc["parameters"].get("required"):
        parameters["required"] = list(doc["parameters"]["required"])
    return {
        "type": "function",
        "function": {"name": doc["name"], "description": _one_line(doc["description"]), "parameters": parameters},
    }
