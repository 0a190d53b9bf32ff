"""Reading a ds_config file the way DeepSpeed does, with problems a user can act on.

DeepSpeed parses its config with hjson and rejects duplicate keys; we must accept and refuse exactly
the same files, or a config that ``check-config`` passes could still stop the job.  What we add is
the where: a duplicate's key path with its values, a syntax error's line and column.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple, Union

import hjson

from .errors import ConfigError, ConfigProblem, key_path, show_value

__all__ = ["read_config_file"]


class _JsonObject(dict):
    """A parsed JSON object that remembers the keys it was given more than once, with their values."""

    duplicates: Dict[str, List[Any]]


def _object_pairs(pairs: List[Tuple[str, Any]]) -> _JsonObject:
    """hjson ``object_pairs_hook``: like DeepSpeed's, but records duplicates so we can name their path."""
    obj = _JsonObject(pairs)
    counts = Counter(key for key, _ in pairs)
    obj.duplicates = {key: [v for k, v in pairs if k == key] for key, n in counts.items() if n > 1}
    return obj


def _duplicate_problems(value: Any, loc: Tuple[Union[str, int], ...] = ()) -> Iterator[ConfigProblem]:
    if isinstance(value, _JsonObject):
        for key, values in value.duplicates.items():
            yield ConfigProblem(key_path(loc + (key, )),
                                f"duplicate key (values {', '.join(show_value(v) for v in values)}); "
                                "expected each key once per object, as DeepSpeed rejects duplicates")
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _duplicate_problems(child, loc + (key, ))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _duplicate_problems(child, loc + (index, ))


def _syntax_problem(text: str, exc: hjson.HjsonDecodeError) -> ConfigProblem:
    """hjson's position, which is where DeepSpeed fails; plus strict JSON's when it is earlier.

    hjson reads unquoted text as strings, so a typo such as ``tru`` or ``01`` is reported where the
    string finally breaks, often at the end of the file; strict JSON points at the typo itself.
    """
    message = f"syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}"
    try:
        json.loads(text)
    except json.JSONDecodeError as strict:
        if (strict.lineno, strict.colno) < (exc.lineno, exc.colno):
            message += f" (read as strict JSON: line {strict.lineno}, column {strict.colno}: {strict.msg})"
    return ConfigProblem("", message)


_UNREADABLE = "hjson, DeepSpeed's reader, cannot read the file (a job given its path stops in deepspeed.initialize)"


def read_config_file(path: Union[str, "os.PathLike[str]"]) -> Any:
    """Parse a ds_config file as DeepSpeed does (hjson, duplicate keys rejected); errors as ConfigError."""
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        where = "" if os.path.isabs(source) else f" (relative to {os.getcwd()})"
        raise ConfigError([ConfigProblem("", f"no such file{where}")], source) from None
    except OSError as exc:
        raise ConfigError([ConfigProblem("", f"cannot read the file: {exc.strerror}")], source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigProblem("", f"not UTF-8 text (byte {exc.start})")], source) from None
    try:
        raw = hjson.loads(text, object_pairs_hook=_object_pairs)
        duplicates = list(_duplicate_problems(raw))
    except hjson.HjsonDecodeError as exc:
        raise ConfigError([_syntax_problem(text, exc)], source) from None
    except OverflowError:  # hjson turns a number such as 1e999 into int(inf)
        raise ConfigError([ConfigProblem("", f"a number out of range (such as 1e999): {_UNREADABLE}")], source) from None
    except RecursionError:
        raise ConfigError([ConfigProblem("", f"nested too deeply: {_UNREADABLE}")], source) from None
    if duplicates:
        raise ConfigError(duplicates, source)
    return raw
