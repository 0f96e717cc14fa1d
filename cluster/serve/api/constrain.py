"""What a request asks its answer to match, in each dialect's words, as one Constraint.

- OpenAI chat: ``response_format`` (``json_schema`` with its ``schema``, ``json_object``),
  ``tool_choice`` ``required`` or a named function, tools with ``strict: true``.
- Responses: ``text.format`` (the same, flat), ``tool_choice``, strict tools.
- Anthropic: ``tool_choice`` ``any`` or ``tool``, ``output_config.format`` (and the beta's
  ``output_format``), tools with ``strict: true``.
- Any dialect, as an extension (vLLM's names): ``structured_outputs`` with one of ``json``
  (a schema), ``regex``, ``grammar`` (Lark, or llama.cpp's GBNF) or ``choice`` (a list of
  strings); the older ``guided_json``, ``guided_regex``, ``guided_grammar``, ``guided_choice``.

A grammar that llguidance does not take is a 400 naming the field and llguidance's reason (the
keyword: "Unimplemented keys: ["not"]"); at most one constraint per request. A forced tool call
becomes its grammar on rank 0, which knows the model's tool-call markup (node.grammar).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from cluster.core import grammar
from cluster.core.spec import Constraint
from cluster.serve.api.shared import RequestError

EXTENSION = "structured_outputs"
EXTENSION_KINDS = {"json": grammar.json_schema, "regex": grammar.regex,
                   "grammar": grammar.lark, "choice": grammar.choice}  # fmt: skip
GUIDED = {f"guided_{k}": k for k in EXTENSION_KINDS}


def built(make, value: Any, name: str) -> Constraint:
    try:
        return Constraint(grammar=make(value), source=name)
    except grammar.BadGrammar as e:
        raise RequestError(400, f"'{name}': {e}") from None


def response_format(value: Any, name: str, flat: bool = False) -> Constraint | None:
    """OpenAI's ``response_format`` (``flat``: Responses' ``text.format``, whose schema is
    beside its type rather than under ``json_schema``)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(400, f"'{name}' must be an object with a 'type'")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return built(grammar.json_schema, {"type": "object"}, name)
    if kind == "json_schema":
        holder = value if flat else value.get("json_schema")
        where = name if flat else f"{name}.json_schema"
        if not isinstance(holder, dict) or "schema" not in holder:
            raise RequestError(400, f"'{where}.schema' is required: the JSON schema to follow")
        return built(grammar.json_schema, holder["schema"], f"{where}.schema")
    raise RequestError(
        400, f"'{name}' of type {kind!r} is not supported (text, json_object or json_schema)"
    )


def extension(body: dict) -> Constraint | None:
    """``structured_outputs`` or a ``guided_*`` field (vLLM's), else None."""
    found: list[Constraint | None] = []
    value = body.get(EXTENSION)
    if value is not None:
        if not isinstance(value, dict):
            raise RequestError(400, f"'{EXTENSION}' must be an object")
        kinds = [k for k in EXTENSION_KINDS if value.get(k) is not None]
        if len(kinds) != 1:
            raise RequestError(
                400, f"'{EXTENSION}' takes exactly one of {', '.join(EXTENSION_KINDS)}"
            )
        found.append(built(EXTENSION_KINDS[kinds[0]], value[kinds[0]], f"{EXTENSION}.{kinds[0]}"))
    for field, kind in GUIDED.items():
        if body.get(field) is not None:
            found.append(built(EXTENSION_KINDS[kind], body[field], field))
    return only(found)


def only(found: Sequence[Constraint | None]) -> Constraint | None:
    """The one constraint asked for; asking two ways is a 400 naming both."""
    asked = [c for c in found if c is not None]
    if len(asked) > 1:
        raise RequestError(
            400,
            f"'{asked[0].source}' and '{asked[1].source}' both constrain the answer; "
            "send one of them",
        )
    return asked[0] if asked else None


def forced(kind: str, tools: list, name: str) -> Constraint:
    """A tool call the answer must be: ``kind`` "required", or the tool's own name."""
    if not tools:
        raise RequestError(400, f"'{name}' forces a tool call, but the request has no tools")
    if kind != "required" and kind not in {t["function"]["name"] for t in tools}:
        raise RequestError(400, f"'{name}' names {kind!r}, which is not among the tools")
    bounded(tools)
    return Constraint(tools=kind, source=name)


def bounded(tools: list) -> None:
    """Tools a call is constrained by: small enough for a grammar (a 400 naming 'tools')."""
    if why := grammar.tool_bounds(tools):
        raise RequestError(400, f"'tools': {why}")


def one_call(constraint: Constraint | None, single: bool) -> Constraint | None:
    """A tool constraint that allows one call at most (OpenAI's ``parallel_tool_calls``
    false, Anthropic's ``disable_parallel_tool_use``)."""
    if constraint is None or constraint.tools is None or not single:
        return constraint
    return dataclasses.replace(constraint, single=True)


def strict(tools: list, marked: list[bool]) -> Constraint | None:
    """Tools marked ``strict``: the model chooses whether to call, a call follows its schema."""
    if not tools or not any(marked):
        return None
    bounded(tools)
    return Constraint(tools="strict", source="tools")
