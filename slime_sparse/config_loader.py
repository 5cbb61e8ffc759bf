"""Where a RunConfig comes from: the command line and the YAML it names, and back to YAML.

Every source becomes ``{section: {field: value}}`` with values typed by the field annotations; the layers are
merged field by field (defaults < preset < ``--config`` YAML < flags) and ``RunConfig.from_dict`` builds the rest
(``slime_sparse.config``): that is `parse_config`, which reads nothing but the YAML. `load_config`, what the
commands call, also checks what the config names (``slime_sparse.startup``) and slime's architecture flags
against config.json (``slime_sparse.model_flags``). The parser is generated from the sections' fields
(``slime_sparse.flags`` names each flag), so a field added to a section is a flag, a YAML key and a ``--help``
line at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import types
import typing
from dataclasses import fields
from typing import Any, Mapping

import yaml

from slime_sparse.config import SECTION_TYPES, SECTIONS, RunConfig, check_sections, field_type, tuple_type
from slime_sparse.flags import ARG, DISABLE_PREFIX, FIXED, NO_FLAG, PASSTHROUGH_FIELD, SPELLINGS, flag_for
from slime_sparse.model_flags import ARCH_FLAGS, arch_help, check_arch_flags
from slime_sparse.rollout.sglang.config import split_passthrough
from slime_sparse.startup import check_inputs

# argparse destination prefix of slime's spellings (they are no field; `_spelled_values` turns them into fields)
SPELLING_DEST = "spelling:"
FIXED_DEST = "fixed:"  # and of slime's flags we take at one value (flags.FIXED; checked, then dropped)
ARCH_DEST = "arch:"  # and of slime's architecture flags (model_flags.ARCH_FLAGS; checked against config.json)
# A word that starts like a number (`-1e-5`, `-.5`) is a value, not a flag. argparse before Python 3.13 only takes
# `-1` and `-1.5` so, and `--lr -1e-5` then fails with "expected one argument"; 3.13's own rule is this one.
NEGATIVE_NUMBER = re.compile(r"^-\.?\d")


def accept_negative_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` reading `--flag -1e-5` as a value (no flag of ours starts with a digit)."""
    parser._negative_number_matcher = NEGATIVE_NUMBER
    return parser

def _parse_value(tp: Any, raw: str | list[str], flag: str) -> Any:
    """Turn command-line strings into a value of annotation `tp` (int, float, str, bool, Optional, tuple). A tuple
    flag takes several arguments (slime's nargs="+"), each of which may also be a comma-separated list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if isinstance(raw, str) and raw.lower() in ("none", "null", ""):
            return None
        return _parse_value(args[0], raw, flag)
    if origin is tuple:
        (elem, *_rest) = typing.get_args(tp)
        items = [x for item in (raw if isinstance(raw, list) else [raw]) for x in item.split(",") if x]
        if elem is not str:  # numbers: "1 2" in one argument too
            items = [x for item in items for x in item.split()]
        return tuple(_parse_value(elem, x, flag) for x in items)
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{flag}={raw!r} is not a boolean")
    try:
        return tp(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{flag}={raw!r} is not a valid {getattr(tp, '__name__', tp)}") from None


def build_parser(prog: str = "slime-sparse-train",
                 description: str = "Sparse-RL training (GRPO on compressed-KV rollouts)") -> argparse.ArgumentParser:
    """The command line: one argument group per config section (the YAML's section names), each flag's help the
    one line in its field's metadata followed by its default."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, argument_default=argparse.SUPPRESS,
        usage="%(prog)s [--config YAML] [--FLAG VALUE ...]",
        epilog="Precedence: defaults < --correction-preset < --config YAML < flags. Any other --sglang-X goes to "
               "every SGLang server as --X.",
    )
    accept_negative_numbers(parser)
    parser.add_argument("--config", metavar="YAML",
                        help="YAML file: {section: {field: value}}, sections as the groups below (default: unset)")
    groups = {section: parser.add_argument_group(section, f"YAML section `{section}:`") for section in SECTIONS}
    seen: dict[str, str] = {}
    for section in SECTIONS:
        cls, group = SECTION_TYPES[section], groups[section]
        for f in fields(cls):
            if f"{section}.{f.name}" in NO_FLAG:
                continue
            flag = flag_for(section, f.name)
            if flag in seen:
                raise RuntimeError(f"flag {flag} is claimed by {seen[flag]} and {section}.{f.name}")
            seen[flag] = f"{section}.{f.name}"
            tp = field_type(cls, f.name)
            dest = f"{section}.{f.name}"
            if tp is bool and flag.startswith(DISABLE_PREFIX):  # slime's store_false switch
                group.add_argument(flag, dest=dest, action="store_false",
                                   help=_help_line(f, "off" if f.default else "on"))
            elif tp is bool or tp == bool | None:
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, help=_help_line(f))
            else:
                nargs = "+" if tuple_type(tp) else None
                group.add_argument(flag, dest=dest, metavar=_metavar(tp), nargs=nargs, help=_help_line(f))
    for flag, spelling in SPELLINGS.items():
        if flag in seen:
            raise RuntimeError(f"flag {flag} is claimed by {seen[flag]} and a slime spelling")
        dest = SPELLING_DEST + flag
        group = groups[next(iter(spelling["sets"])).split(".")[0]]  # the section of the fields it sets
        if "type" in spelling:
            group.add_argument(flag, dest=dest, metavar=spelling["type"].__name__.upper(),
                               help=f"{spelling['help']} (default: unset)")
        else:
            group.add_argument(flag, dest=dest, action="store_true", help=f"{spelling['help']} (default: off)")
    for flag, (section, tp, value, why) in FIXED.items():
        groups[section].add_argument(flag, dest=FIXED_DEST + flag, metavar=tp.__name__.upper(),
                                     help=f"accepted as slime's {flag} {value} only: {why} (default: {value})")
    for flag, arch in ARCH_FLAGS.items():  # with Megatron's other flags
        kw = ({"action": "store_true"} if arch.kind is None
              else {"type": arch.kind, "metavar": arch.kind.__name__.upper()})
        groups["megatron"].add_argument(flag, dest=ARCH_DEST + flag, help=f"{arch_help(flag)} (default: unset)", **kw)
    return parser


def _help_line(f: dataclasses.Field, default: str | None = None) -> str:
    """The help of a field's flag: its metadata's one line, then its default."""
    text = f.metadata.get("help")
    if not text or "\n" in text:
        raise RuntimeError(f"field {f.name} needs a one-line metadata help (the text of its flag)")
    return f"{text} (default: {_default_text(f) if default is None else default})"


def _default_text(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if value is None or value == "" or value == ():
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)


def _metavar(tp: Any) -> str:
    if typing.get_origin(tp) is tuple:  # several arguments: name one
        return _metavar(typing.get_args(tp)[0])
    return getattr(tp, "__name__", str(tp)).upper().replace(" ", "")


def _read_yaml(path: str) -> Mapping[str, Mapping[str, Any]]:
    """{section: {field: value}} of a --config file, each value checked against its field's type."""
    if not os.path.isfile(path):
        raise ValueError(f"--config={path!r} does not exist")
    with open(path, encoding="utf-8") as fh:
        try:
            raw = yaml.safe_load(fh) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ValueError(f"--config {path}: not valid YAML{where}: {problem}") from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"--config {path}: must be a mapping {{section: {{field: value}}}}, got a "
                         f"{type(raw).__name__}")
    check_sections(raw, path)
    return {section: {key: _yaml_value(section, key, value, path) for key, value in values.items()}
            for section, values in raw.items()}


def _yaml_value(section: str, key: str, value: Any, path: str) -> Any:
    """`value` of field `section.key` from YAML file `path`, checked against the field's annotation (unknown fields
    pass through: build_section names them). YAML types its own values, so nothing is parsed from strings, except
    floats: PyYAML reads `1e-6` (no dot) as a string."""
    cls = SECTION_TYPES[section]
    if key not in {f.name for f in fields(cls)}:
        return value
    tp = field_type(cls, key)
    try:
        return _typed(tp, value)
    except TypeError:
        raise ValueError(f"--config {path}: {section}.{key}: expected {_type_name(tp)}, got {value!r}") from None


def _typed(tp: Any, value: Any) -> Any:
    """`value` as annotation `tp` (bool, int, float, str, Optional, tuple) or TypeError; no lossy conversion."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _typed(inner, value)
    if origin is tuple:
        elem = typing.get_args(tp)[0]
        items = value if isinstance(value, (list, tuple)) else [value]  # one value: a one-element list
        return tuple(_typed(elem, x) for x in items)
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise TypeError from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise TypeError
    if tp is int and isinstance(value, bool):  # a bool is an int to Python, not to a user
        raise TypeError
    if not isinstance(value, tp):
        raise TypeError
    return value


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None)) + " or null"
    if origin is tuple:
        elem = typing.get_args(tp)[0]
        return "a list of " + {bool: "booleans", int: "integers", float: "numbers", str: "strings"}.get(elem, str(elem))
    return {bool: "a boolean (true / false)", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _flag_values(args: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{section: {field: typed value}} of the parsed flags (dest "section.field"), slime's spellings included."""
    out: dict[str, dict[str, Any]] = {}
    for dest, raw in args.items():
        if dest.startswith(FIXED_DEST):
            _check_fixed(dest.removeprefix(FIXED_DEST), raw)
        if dest.startswith((SPELLING_DEST, FIXED_DEST)):
            continue
        section, name = dest.split(".", 1)
        tp = field_type(SECTION_TYPES[section], name)
        out.setdefault(section, {})[name] = raw if isinstance(raw, bool) else _parse_value(tp, raw, flag_for(section, name))
    for (section, name), value in _spelled_values(args, out).items():
        out.setdefault(section, {})[name] = value
    return out


def _check_fixed(flag: str, raw: str) -> None:
    """A slime flag we take only at one value (flags.FIXED): that value, or a one-line refusal."""
    _section, tp, value, why = FIXED[flag]
    if _parse_value(tp, raw, flag) != value:
        raise ValueError(f"{flag}={raw} is not supported ({why}): only {value} is")


def _spelled_values(args: Mapping[str, Any], own: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, str], Any]:
    """The field values slime's spellings given in `args` set (flags.SPELLINGS); a spelling without the one it
    needs, or a field its own flag (in `own`) sets to another value, is refused."""
    given = {flag: args[SPELLING_DEST + flag] for flag in SPELLINGS if SPELLING_DEST + flag in args}
    values: dict[tuple[str, str], Any] = {}
    for flag, raw in given.items():
        spelling = SPELLINGS[flag]
        needs = spelling.get("needs")
        if needs and needs not in given:
            raise ValueError(f"{flag} has no effect without {needs}")
        arg = _parse_value(spelling["type"], raw, flag) if "type" in spelling else None
        for key, value in spelling["sets"].items():
            section, name = key.split(".", 1)
            value = arg if value == ARG else value
            if name in own.get(section, {}) and own[section][name] != value:
                raise ValueError(f"{flag} sets {flag_for(section, name)}={value!r}, but it is also given as "
                                 f"{own[section][name]!r}: use one of the two")
            values[section, name] = value
    return values


def parse_config(argv: list[str] | None = None) -> tuple[RunConfig, dict[str, Any]]:
    """Flags (and the YAML they name) as a validated RunConfig, and slime's architecture flags given
    ({flag: value}); nothing else is read (`load_config` checks what the config names)."""
    parser = build_parser()
    # like slime: any --sglang-X that is not ours goes to every SGLang server as --X
    argv, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv),
                                          {o for a in parser._actions for o in a.option_strings})
    args = vars(parser.parse_args(argv))
    arch = {dest.removeprefix(ARCH_DEST): args.pop(dest) for dest in list(args) if dest.startswith(ARCH_DEST)}
    layers = [_read_yaml(args.pop("config"))] if "config" in args else []
    layers.append(_flag_values(args))
    if passthrough:
        section, name = PASSTHROUGH_FIELD.split(".")
        layers.append({section: {name: tuple(passthrough)}})
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:  # later layers win, field by field
        for section, values in layer.items():
            merged.setdefault(section, {}).update(values)
    return RunConfig.from_dict(merged), arch


def load_config(argv: list[str] | None = None) -> RunConfig:
    """The run config of a command line, checked against the files and modules it names (slime_sparse.startup)
    and against the architecture flags given (slime_sparse.model_flags)."""
    cfg, arch = parse_config(argv)
    cfg = check_inputs(cfg)
    if arch:
        where = os.path.join(cfg.train.hf_checkpoint, "config.json")
        try:
            with open(where, encoding="utf-8") as fh:
                hf_config = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{next(iter(arch))}: cannot read {where} to check it against ({exc})") from None
        check_arch_flags(arch, hf_config, where)
    return cfg


def save_config(cfg: RunConfig, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)
