"""The base of every pydantic model a user writes (config tables, per-call settings, plugin
options) and how its errors read.

A user-written value is taken as written: strict types (``true`` is not a number, ``"4"`` is not
4, ``2.0`` is not an integer; an integer is a fine float), finite floats only, unknown keys are
errors, and every size has a maximum. Each error is one line naming the field and, for a value out
of range, the allowed range; never pydantic's raw text or its links.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import annotated_types as at
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# Written as a string in a file or a dict; strict mode would want a Path object.
LaxPath = Annotated[Path, Field(strict=False)]

TOKEN_ID_MAX = 2**31 - 1  # larger than any vocabulary; ids past the target's own are refused later
CONTEXT_MAX = 2**24  # tokens: more than any model's context window (16M)
SEED_MAX = 2**64 - 1
COUNT_MAX = 1_000_000  # cycles, requests and other counters in plugin options


def sequence_of(item: Any, max_items: int) -> Any:
    """A list field that also takes a tuple or set (its items stay strict), at most ``max_items``."""
    return Annotated[list[item], Field(strict=False, max_length=max_items)]


class UserModel(BaseModel):
    """Base of a model a user writes: strict types, finite floats, no unknown keys. Plugins'
    ``options_model`` may derive from it to read like the engine's own config."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


_TYPES = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
          "string_type": "a string", "list_type": "a list", "dict_type": "a table", "model_type": "a table",
          "path_type": "a path (a string)"}
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_\-]+")
_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
_SIGNS = ((at.Gt, "gt", ">"), (at.Ge, "ge", "≥"), (at.Lt, "lt", "<"), (at.Le, "le", "≤"))


def error_lines(exc: ValidationError, model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """One ``field.path: message`` line per error of ``exc`` (raised validating ``model``)."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        field = ".".join([prefix] * bool(prefix) + [_key(p) for p in loc]) or "(root)"
        lines.append(f"{field}: {error_message(err, _metadata(model, loc))}")
    return lines


def _key(part: Any) -> str:
    """A path part as written, quoted when it is not a plain key (a key holding a newline, say)."""
    text = str(part)
    return text if _PLAIN_KEY.fullmatch(text) else repr(text)


def error_message(err: dict, metadata: list | None = None) -> str:
    """One pydantic error as a short sentence (the allowed range from ``metadata`` when known)."""
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        return "unknown key (check the spelling; see docs/configuration.md)"
    if kind == "missing":
        return "required key is missing"
    if kind == "finite_number":
        return f"{_show(value)} is not a finite number; use a finite value"
    if kind in _BOUND_ERRORS:
        return f"{_show(value)} is out of range: allowed {bounds_text(metadata or [], err.get('ctx'))}"
    if kind == "too_long":
        return f"has {err['ctx']['actual_length']} items; at most {err['ctx']['max_length']} are allowed"
    if kind == "string_too_long":
        return f"is {len(value)} characters long; at most {err['ctx']['max_length']} are allowed"
    if _TYPES.get(kind):
        return f"expected {_TYPES[kind]}, got {_type_name(value)} {_show(value)}"
    return str(err["msg"])


def bounds_text(metadata: list, ctx: dict | None = None) -> str:
    """``≥ 1 and ≤ 64`` from a field's constraints (or only the violated one, from ``ctx``)."""
    parts = [f"{sign} {_show(getattr(item, attr))}" for cls, attr, sign in _SIGNS for item in metadata
             if isinstance(item, cls)]
    if not parts and ctx:
        parts = [f"{sign} {_show(ctx[attr])}" for _, attr, sign in _SIGNS if attr in ctx]
    return " and ".join(parts) or "values"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "float", str: "string", list: "list", dict: "table"}
    return names.get(type(value), type(value).__name__)


def _metadata(model: type[BaseModel] | None, loc: tuple) -> list | None:
    """The constraints of the field (or list item) at ``loc`` in ``model``, if it can be found."""
    annotation: Any = model
    metadata: list = []
    for part in loc:
        annotation, metadata = _unwrap(annotation)
        if isinstance(part, int) and typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
            metadata = []
            continue
        sub = next((m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)
                    and part in m.model_fields), None)
        if sub is None:
            return None
        field = sub.model_fields[part]
        annotation, metadata = field.annotation, list(field.metadata)
    return metadata + _unwrap(annotation)[1]


def _unwrap(annotation: Any) -> tuple[Any, list]:
    """``(type, constraints)`` of an ``Annotated`` type (the one non-None member of an optional)."""
    members = [m for m in _members(annotation) if m is not type(None)]
    if len(members) == 1:
        annotation = members[0]
    if typing.get_origin(annotation) is Annotated:
        base, *extra = typing.get_args(annotation)
        found = []
        for item in extra:
            found += list(getattr(item, "metadata", [])) if hasattr(item, "metadata") else [item]
        return base, found
    return annotation, []


def _members(annotation: Any) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)
