"""``DS_PROFUTILS_<SECTION>_<FIELD>`` environment variables: the last word on our own sections' settings.

A launcher or a cluster script can change one setting for one run without editing the shared
ds_config.json.  Values are parsed from an explicit table (``DS_PROFUTILS_NVTX_ENABLED=0`` means
off).  A variable naming no setting (a misspelling, or one leaked from another job's environment:
module files, shell profiles and schedulers export variables between jobs) is an error for
``ds-profutils check-config`` and, in a job, a warning naming the closest setting, then ignored: a stray
variable must not stop a job whose config file is its own.  A bad value of a known setting stays an
error everywhere.  The section models are passed in by :mod:`.loading`, which decides when the
environment is applied.
"""
from __future__ import annotations

import difflib
import logging
import math
import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type, TypeVar

from pydantic import BaseModel, ValidationError

from ..outputs import process_identity
from .errors import ConfigError, ConfigProblem, describe_error, key_path, not_allowed

__all__ = [
    "BOOL_FALSE", "BOOL_TRUE", "ENV_PREFIX", "apply_environment", "environment_overrides",
    "raw_with_environment", "read_environment", "with_values"
]

# The sections the environment may override, by their key in ds_config.
Sections = Mapping[str, Type[BaseModel]]

ENV_PREFIX = "DS_PROFUTILS_"

# DS_PROFUTILS_* variables that are not settings (build and test tooling), so not "unknown".
_NOT_SETTINGS = frozenset({"DS_PROFUTILS_TOX_DIR"})

BOOL_TRUE = frozenset({"1", "true", "yes", "on"})
BOOL_FALSE = frozenset({"0", "false", "no", "off"})
_BOOL_EXPECTED = "1/0, true/false, yes/no or on/off (any case)"

_INTEGER = re.compile(r"[+-]?[0-9]+")


def _parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in BOOL_TRUE:
        return True
    if word in BOOL_FALSE:
        return False
    raise ValueError(text)


def _parse_int(text: str) -> int:
    if not _INTEGER.fullmatch(text.strip()):
        raise ValueError(text)
    return int(text)


# How an environment string becomes a value of each field type: (parser, what is allowed).  The
# field's own checks (ranges, sort keys) run afterwards, as for a value from the file.
_ENV_READERS: Dict[Any, Tuple[Callable[[str], Any], str]] = {
    bool: (_parse_bool, _BOOL_EXPECTED),
    int: (_parse_int, "an integer"),
    float: (lambda text: _finite(float(text)), "a number"),
}


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(value)
    return value


def _parse_optional_number(text: str) -> Optional[float]:
    """A number (``312``, ``989.5``), or ``null`` for none: a non-finite value is no setting of ours."""
    word = text.strip()
    if word.lower() == "null":
        return None
    value = float(word)  # ValueError for anything else
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _parse_ranks(text: str) -> Optional[List[int]]:
    return None if text.strip().lower() == "all" else [_parse_int(part) for part in text.split(",")]


def _parse_integers(text: str) -> List[int]:
    return [_parse_int(part) for part in text.split(",")] if text.strip() else []


def _env_reader(annotation: Any) -> Tuple[Callable[[str], Any], str]:
    if annotation == Optional[List[int]]:  # a list of global ranks, null for all
        return _parse_ranks, "comma-separated integers, or all"
    if annotation == List[int]:  # a list of global steps
        return _parse_integers, "comma-separated integers (empty for none)"
    if annotation == Optional[float]:  # a figure such as peak_tflops, null for none
        return _parse_optional_number, "a number, or null"
    return _ENV_READERS.get(annotation, (str, "a string"))  # str, or a type whose own checks say more


def environment_overrides() -> Dict[str, str]:
    """The ``DS_PROFUTILS_*`` variables set in this process that override settings (for logging them)."""
    return {name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)
            and name not in _NOT_SETTINGS}


def _variable(section: str, field: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}_{field.upper()}"


def _split_variable(name: str, sections: Sections) -> Tuple[Optional[str], Optional[str], Optional[ConfigProblem]]:
    """Map ``DS_PROFUTILS_<SECTION>_<FIELD>`` to (section, field), or say why it maps to nothing."""
    rest = name[len(ENV_PREFIX):]
    for section, model in sections.items():
        head = section.upper() + "_"
        if rest.startswith(head):
            field = rest[len(head):].lower()
            if field in model.model_fields:
                return section, field, None
            fields = sorted(model.model_fields)
            close = difflib.get_close_matches(field, fields, n=1)
            hint = f" (did you mean {_variable(section, close[0])}?)" if close else ""
            return None, None, ConfigProblem(
                name, f"unknown variable{hint}; {section} settings are {_variable(section, '<FIELD>')} "
                f"with FIELD one of {', '.join(f.upper() for f in fields)}")
    return None, None, ConfigProblem(
        name, f"unknown variable; expected {ENV_PREFIX}<SECTION>_<FIELD> with SECTION one of "
        f"{', '.join(s.upper() for s in sections)}")


_warned_unknown: set = set()  # variables already warned about in this process


def closest_variable(name: str, sections: Sections) -> str:
    """The known variable nearest to ``name`` (there always is one: the warning names it)."""
    rest = name[len(ENV_PREFIX):]
    for section, model in sections.items():  # a known section: the nearest of its fields
        if rest.startswith(section.upper() + "_"):
            fields = [field.upper() for field in model.model_fields]
            nearest = difflib.get_close_matches(rest[len(section) + 1:], fields, n=1, cutoff=0.0)[0]
            return _variable(section, nearest)
    known = [_variable(section, field) for section, model in sections.items() for field in model.model_fields]
    return difflib.get_close_matches(name, known, n=1, cutoff=0.0)[0]


def _warn_unknown(name: str, sections: Sections) -> None:
    """Once per process, on rank 0: ``name`` sets nothing and is ignored."""
    if name in _warned_unknown:
        return
    _warned_unknown.add(name)
    if process_identity().rank == 0:
        logging.getLogger("DeepSpeed").warning(
            "ds_profutils: environment variable %s names no setting (closest: %s); it is ignored "
            "(ds-profutils check-config rejects it)", name, closest_variable(name, sections))


def read_environment(sections: Sections,
                     strict: bool = False) -> Tuple[Dict[str, Dict[str, Tuple[str, Any]]], List[ConfigProblem]]:
    """Parse every override: {section: {field: (variable, value)}}, and the problems found.  A variable
    naming no setting is a problem when ``strict`` (check-config), else warned about once and ignored."""
    overrides: Dict[str, Dict[str, Tuple[str, Any]]] = {}
    problems: List[ConfigProblem] = []
    for name, text in sorted(environment_overrides().items()):
        section, field, problem = _split_variable(name, sections)
        if problem is not None:
            if strict:
                problems.append(problem)
            else:
                _warn_unknown(name, sections)
            continue
        parse, expected = _env_reader(sections[section].model_fields[field].annotation)
        try:
            value = parse(text)
        except ValueError:
            problems.append(ConfigProblem(name, f"{not_allowed(text, expected)} (sets {section}.{field})"))
            continue
        overrides.setdefault(section, {})[field] = (name, value)
    return overrides, problems


def raw_with_environment(raw: Mapping[str, Any], sections: Sections) -> Dict[str, Any]:
    """A file's own sections with the ``DS_PROFUTILS_*`` variables' values set over them, as a job takes them (for
    checks on the raw values where the file does not validate; the variables' own problems are named by loading)."""
    overrides, _ = read_environment(sections, strict=True)
    given = dict(raw)
    for name, fields in overrides.items():
        section = raw.get(name)
        given[name] = {**(section if isinstance(section, Mapping) else {}),
                       **{field: value for field, (_, value) in fields.items()}}
    return given


ModelT = TypeVar("ModelT", bound=BaseModel)


def with_values(section: ModelT, values: Mapping[str, Any]) -> ModelT:
    """``section`` with ``values`` set, validated again (raising ValidationError).  What was left out stays left
    out: a default derived from other fields (``summary_ranks``) follows them."""
    return type(section).model_validate({**section.model_dump(exclude_unset=True), **values})


def apply_environment(section: ModelT, name: str, overrides: Mapping[str, Tuple[str, Any]]) -> ModelT:
    """``section`` with the environment's values set; errors name the variable that set the bad value."""
    if not overrides:
        return section
    try:
        return with_values(section, {field: value for field, (_, value) in overrides.items()})
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            # A check across fields has no single field: name every variable that took part.
            variable = overrides[field][0] if field in overrides else ", ".join(v for v, _ in overrides.values())
            key = key_path((name, *error["loc"]))
            problems.append(ConfigProblem(variable, f"{describe_error(error, type(section))} (sets {key})"))
        raise ConfigError(problems) from None
