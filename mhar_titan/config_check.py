"""Checks every value of a job's TOML file against the type of the config field it sets, before torchtitan
parses anything.

Why: torchtitan's ConfigManager hands TOML values to tyro as defaults, and tyro only warns when a default
has the wrong type, then keeps it: `[ema] enable = "false"` is a non-empty string, so the EMA runs;
`[training] steps = "4"` fails much later with a bare TypeError; `[data] seed = 1.5` runs with a float seed.
torchtitan refuses an unknown key in a table, but names neither the file nor a likely intended key, stops
at the first table, and ignores a scalar given where a table belongs (`ema = 5` runs with the defaults).

The fields are those of the class torchtitan itself builds (its JobConfig merged with the custom config
module's), taken from its own ConfigManager, so the check cannot drift from what the parser will accept.
"""

import dataclasses
import datetime
import difflib
import json
import tomllib
import types
import typing
from typing import Any, Literal, Union

from torchtitan.config import ConfigManager

CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")
MODULE_FLAGS = ("--job.custom_config_module", "--job.custom-config-module")
_MAX_SHOWN = 80  # characters of a value quoted in a message


class _Unchecked(Exception):
    """A field annotation this module has no rule for: refused rather than let through unchecked."""


def config_file_path(argv: list[str]) -> str | None:
    """The TOML file torchtitan will load, found as its ConfigManager finds it (the first flag given)."""
    for i, arg in enumerate(argv):
        if "=" in arg:
            key, value = arg.split("=", 1)
            if key in CONFIG_FILE_FLAGS:
                return value
        elif i < len(argv) - 1 and arg in CONFIG_FILE_FLAGS:
            return argv[i + 1]
    return None


def _cli_module(argv: list[str]) -> str | None:
    """The custom config module named on the command line, found as torchtitan's ConfigManager finds it."""
    for i, arg in enumerate(argv):
        if arg.split("=")[0] in MODULE_FLAGS:
            if "=" in arg:
                return arg.split("=", 1)[1]
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


def load_toml(path: str) -> dict[str, Any]:
    """The parsed file; a syntax error is re-raised as a ValueError that names the file."""
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from e


def check_config_file(argv: list[str], manager: ConfigManager, module_by_default: bool = False) -> None:
    """Raise one ValueError listing every problem of argv's `--job.config_file` (nothing to do without one).

    `manager` is the ConfigManager that will then parse argv: its merged JobConfig is the schema checked.
    `module_by_default`: the caller, not the user, put `--job.custom_config_module` in argv; a different
    module named in the TOML would then be ignored without a word, so it is refused.
    """
    path = config_file_path(argv)
    if path is None:
        return
    values = load_toml(path)
    config_cls = manager._maybe_add_custom_config(argv, values)  # torchtitan's own lookup and merge
    problems = toml_problems(values, config_cls)
    if module_by_default:
        problems += _ignored_module(values, _cli_module(argv))
    if problems:
        raise ValueError("\n".join(f"{path}: {p}" for p in problems))


def toml_problems(values: dict[str, Any], config_cls: type) -> list[str]:
    """Every key of a parsed TOML document that config_cls would not take as written, one line each."""
    problems: list[str] = []
    _check_table(values, config_cls, (), problems)
    return problems


def _ignored_module(values: dict[str, Any], cli_module: str | None) -> list[str]:
    """A TOML `[job] custom_config_module` that the caller's default module overrides."""
    job = values.get("job")
    named = job.get("custom_config_module") if isinstance(job, dict) else None
    if cli_module is None or not isinstance(named, str) or named == cli_module:
        return []
    return [
        f"[job] custom_config_module = {_written(named)}: not used, the sections come from {_written(cli_module)} "
        "(train_cpt.py's default); name the module on the command line: --job.custom_config_module"
    ]


def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation (a module with `from __future__ import annotations` has strings)."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError) as e:
        raise TypeError(f"cannot resolve the field types of config section {cls.__qualname__}: {e}") from e
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


def _check_table(table: dict[str, Any], cls: type, section: tuple[str, ...], problems: list[str]) -> None:
    known = _field_types(cls)
    for key, value in table.items():
        if key not in known:
            problems.append(_unknown(key, value, section, known))
            continue
        expected = known[key]
        if dataclasses.is_dataclass(expected):
            if isinstance(value, dict):
                _check_table(value, expected, (*section, key), problems)
            else:
                name = ".".join((*section, key))
                problems.append(f"{_where(section, key, value)}: expected a table [{name}], got {_kind(value)}")
            continue
        try:
            ok = _accepts(expected, value)
        except _Unchecked:
            problems.append(
                f"{_where(section, key, value)}: the field's type {_type_name(expected)} has no check here; "
                "set it on the command line"
            )
            continue
        if not ok:
            got = "" if _literal_miss(expected, value) else f", got {_kind(value)}"
            problems.append(f"{_where(section, key, value)}: expected {_expected(expected)}{got}")


def _unknown(key: str, value: Any, section: tuple[str, ...], known: dict[str, Any]) -> str:
    """An unknown section or key, with the closest known name of the same table."""
    sections = [k for k, t in known.items() if dataclasses.is_dataclass(t)]
    if isinstance(value, dict):
        close = difflib.get_close_matches(key, sections, n=1)
        hint = f"; did you mean [{'.'.join((*section, close[0]))}]?" if close else ""
        return f"[{'.'.join((*section, key))}]: unknown section{hint}"
    where = _where(section, key, value)
    if not section:  # a key above the first [section] header
        homes = [s for s in sections if key in {f.name for f in dataclasses.fields(known[s])}]
        hint = f"; did you mean {', '.join(f'[{s}] {key}' for s in homes)}?" if homes else ""
        return f"{where}: unknown top-level key (settings belong under a [section] header){hint}"
    close = difflib.get_close_matches(key, [k for k in known if k not in sections], n=1)
    name = ".".join(section)
    return f"{where}: unknown key in [{name}]" + (f'; did you mean "{close[0]}"?' if close else "")


def _where(section: tuple[str, ...], key: str, value: Any) -> str:
    setting = f"{key} = {_written(value)}"
    return f"[{'.'.join(section)}] {setting}" if section else setting


def _written(value: Any) -> str:
    """The value in TOML syntax, as the file wrote it (shortened when long)."""
    text = _toml(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    return repr(value)  # int, float (inf and nan print as TOML writes them)


_KINDS = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", dict: "a table"}
_PLURALS = {bool: "booleans", int: "integers", float: "floats", str: "strings", dict: "tables", list: "arrays"}


def _kind(value: Any) -> str:
    """What the TOML value is, in TOML's words."""
    if isinstance(value, list):
        if not value:
            return "an empty array"
        kinds = list(dict.fromkeys(_PLURALS.get(type(v), "dates/times") for v in value))
        return "an array of " + (", ".join(kinds[:-1]) + " and " if len(kinds) > 1 else "") + kinds[-1]
    return _KINDS.get(type(value), "a date/time")


def _members(tp: Any) -> list[Any]:
    """A union's members (TOML has no null, so None is never one a file can give), or [tp]."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [m for a in typing.get_args(tp) for m in _members(a) if m is not type(None)]
    return [tp]


def _bare(tp: Any) -> Any:
    """typing.List and the like, unparametrised, as the plain container type."""
    origin = typing.get_origin(tp)
    return origin if origin in (list, tuple, dict) and not typing.get_args(tp) else tp


def _accepts(tp: Any, value: Any) -> bool:
    """Whether the TOML value is of the annotated type: bools, ints, floats and strings never stand in for
    one another, except an integer for a float."""
    if tp is Any or tp is object:
        return True
    tp = _bare(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return any(_accepts(m, value) for m in _members(tp))
    if origin is Literal:
        return any(type(value) is type(v) and value == v for v in args)
    if tp in (bool, int, str):
        return type(value) is tp
    if tp is float:
        return type(value) in (int, float)
    if tp is list or tp is tuple:
        return isinstance(value, list)
    if tp is dict:
        return isinstance(value, dict)
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return isinstance(value, list) and all(_accepts(args[0], v) for v in value)
    if origin is tuple:
        return isinstance(value, list) and len(value) == len(args) and all(map(_accepts, args, value))
    if origin is dict and args[0] is str:
        return isinstance(value, dict) and all(_accepts(args[1], v) for v in value.values())
    raise _Unchecked(tp)


def _literal_miss(tp: Any, value: Any) -> bool:
    """The value is of the right kind but not one of the allowed values (then 'got a string' says nothing)."""
    members = _members(tp)
    if not all(typing.get_origin(m) is Literal for m in members):
        return False
    return any(type(value) is type(v) for m in members for v in typing.get_args(m))


def _expected(tp: Any) -> str:
    """What the field takes, in TOML's words."""
    members = _members(tp)
    literals = [v for m in members if typing.get_origin(m) is Literal for v in typing.get_args(m)]
    others = [m for m in members if typing.get_origin(m) is not Literal]
    if float in others and int in others:
        others.remove(int)
    words = [_one(m) for m in others]
    if literals:
        words.insert(0, "one of " + ", ".join(_toml(v) for v in literals))
    return " or ".join(dict.fromkeys(words)) or "no value (it can only be set on the command line)"


def _one(tp: Any) -> str:
    singular = {
        bool: "a boolean (true or false)",
        int: "an integer",
        float: "a number (integer or float)",
        str: "a string",
        list: "an array",
        tuple: "an array",
        dict: "a table",
    }
    tp = _bare(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in singular:
        return singular[tp]
    if origin is list or (origin is tuple and args[-1] is Ellipsis):
        return "an array of " + _plural(args[0])
    if origin is tuple:
        return f"an array of {len(args)} values: " + ", ".join(_one(a) for a in args)
    if origin is dict:
        return "a table of " + _plural(args[1])
    return _type_name(tp)


def _plural(tp: Any) -> str:
    members = _members(tp)
    literals = [v for m in members if typing.get_origin(m) is Literal for v in typing.get_args(m)]
    words = ["values among " + ", ".join(_toml(v) for v in literals)] if literals else []
    for m in members:
        if typing.get_origin(m) in (list, tuple, dict):
            words.append(_one(m).replace("an array", "arrays", 1).replace("a table", "tables", 1))
        elif typing.get_origin(m) is not Literal:
            words.append({float: "numbers"}.get(m, _PLURALS.get(m, _type_name(m))))
    return " or ".join(dict.fromkeys(words))


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is None and isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")
