"""Settings problems, reported as a user would find them: by key path, with what is allowed.

pydantic's errors speak of Python types and ``loc`` tuples; someone fixing a ds_config.json wants
``profiler.active: 0 is not allowed; expected an integer >= 1``, for every problem at once.  The
file reader, the environment overrides and the section models all report through these classes, so
the wording lives in one place.  Nothing here knows our models: callers pass the root model in.
"""
from __future__ import annotations

import difflib
import json
import typing
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Sequence, Tuple, Type, Union

from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

__all__ = [
    "ConfigError", "ConfigProblem", "describe_error", "key_path", "not_allowed", "problems_from", "show_value",
    "unknown_key_message"
]


class ConfigProblem(typing.NamedTuple):
    """One thing wrong with the settings: where (``key``) and what, with what is allowed (``message``).

    ``key`` is a dotted key path (``profiler.active``, ``profiler.ranks[0]``), an environment variable,
    or empty when the problem is the file as a whole (unreadable, a syntax error).
    """

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class ConfigError(ValueError):
    """Bad ds_profutils settings; carries every problem found, not just the first.

    A user fixing a config before a long job wants the whole list in one go.  ``str()`` gives one
    line per problem, each prefixed with ``source`` (the file) when there is one.
    """

    def __init__(self, problems: Iterable[ConfigProblem], source: Optional[str] = None) -> None:
        self.problems: Tuple[ConfigProblem, ...] = tuple(problems)
        self.source = source
        super().__init__("\n".join(self.lines()))

    def lines(self) -> List[str]:
        """One line per problem, as ``check-config`` prints them."""
        prefix = f"{self.source}: " if self.source else ""
        return [f"{prefix}{problem}" for problem in self.problems]


def show_value(value: Any) -> str:
    """A value as the user wrote it in JSON (``true``, ``"x"``), shortened so a line stays readable."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def not_allowed(value: Any, expected: str) -> str:
    return f"{show_value(value)} is not allowed; expected {expected}"


def key_path(loc: Sequence[Union[str, int]]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


_EXPECTED_BY_ERROR_TYPE = {
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "model_type": "an object",
}

_COMPARISONS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _model_at(root: Type[BaseModel], loc: Sequence[Union[str, int]]) -> Optional[Type[BaseModel]]:
    """The model class that validates the object at ``loc`` (for listing its allowed keys)."""
    model: Any = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def unknown_key_message(key: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown key{hint}; allowed keys: {', '.join(sorted(allowed))}"


def describe_error(error: "ErrorDetails", root: Type[BaseModel]) -> str:
    """What is wrong with one value and what is allowed, in the words of a JSON user."""
    kind, value, ctx = error["type"], error["input"], error.get("ctx", {})
    if kind == "extra_forbidden":
        model = _model_at(root, error["loc"][:-1])
        return unknown_key_message(str(error["loc"][-1]), list(model.model_fields) if model else [])
    if kind == "value_error":  # our validators phrase their error as what is expected
        return not_allowed(value, str(ctx["error"]))
    if kind in _COMPARISONS:
        bound = next(iter(ctx.values()))
        number = "an integer" if isinstance(bound, int) else "a number"
        return not_allowed(value, f"{number} {_COMPARISONS[kind]} {bound}")
    if kind == "string_too_short":
        return not_allowed(value, "a non-empty string")
    if kind in _EXPECTED_BY_ERROR_TYPE:
        return not_allowed(value, _EXPECTED_BY_ERROR_TYPE[kind])
    # An error we have no words for (a field added later, say): keep pydantic's.
    return f"{show_value(value)} is not allowed: {error['msg'][0].lower()}{error['msg'][1:]}"


def problems_from(exc: ValidationError, root: Type[BaseModel], prefix: Tuple[str, ...] = ()) -> List[ConfigProblem]:
    return [ConfigProblem(key_path(prefix + tuple(e["loc"])), describe_error(e, root)) for e in exc.errors()]
