"""One way to configure a process: a config dataclass, read from defaults < a TOML file < environment < flags.

Every process (the daemon, `kvstore-api`, a decode instance) describes itself with a `Command`: its config
dataclass, its program name and its environment prefix. From the dataclass alone come

* a flag per field, `--<name>` (underscores as dashes), explained by the comment beside or above the field
  (or a line of `descriptions` for a field without one), with its default;
* a variable per field, `<PREFIX><NAME>` (KVSTORE_PORT for the daemon's port), over the TOML file named by
  --config or `<PREFIX>CONFIG`, whose keys are the field names; an unknown key is refused by name.

Values are parsed by the field's type, written as an operator writes them:

* a switch (bool): `--name` turns it on and `--no-name` off; `--name=false` and the words true/false,
  yes/no, on/off, 1/0 are accepted too, in a flag, the environment and the file alike;
* a field named `*_bytes` (or `*_bytes_*`) is a size, "64MiB" or bytes; one named `*_s` a duration, "90s"
  or seconds (kvstore/units.py, the one parser of both);
* an optional field (`X | None`) is unset by "off", "none" or an empty value;
* a list (`tuple[...]`) and a table (`dict[str, ...]`) are "a,b" and "k=v,k=v" in a flag or a variable, a
  list and a table in TOML; their flags may be repeated, each adding items.

Imports only the standard library, kvstore.startup and kvstore.units: the daemon, which never imports torch, uses it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import os
import textwrap
import tokenize
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvstore.startup import exit_at_startup
from kvstore.units import format_duration, format_size, parse_duration, parse_size

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

_BOOLEANS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
_UNSET = ("", "none", "off")  # what unsets an optional setting


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _BOOLEANS:
        return _BOOLEANS[value.strip().lower()]
    raise ValueError(f"expected true or false, got {value!r}")


def unit(name: str) -> str | None:
    """"size" for a field named *_bytes or *_bytes_*, "duration" for one named *_s, else None."""
    if name.endswith("_bytes") or "_bytes_" in name:
        return "size"
    if name.endswith("_s"):
        return "duration"
    return None


@dataclass(frozen=True)
class Command(Generic[T]):
    """How one process is configured: its config dataclass, and the names its settings go by."""

    config: type[T]
    prog: str
    description: str
    env_prefix: str  # "KVSTORE_": the daemon's port is KVSTORE_PORT, its TOML file KVSTORE_CONFIG
    # field -> its help, for a field whose definition has no comment of its own
    descriptions: Mapping[str, str] = field(default_factory=dict)
    # field -> another flag it answers to, without the dashes: the singular of a repeatable flag ("api_key")
    aliases: Mapping[str, str] = field(default_factory=dict)
    metavars: Mapping[str, str] = field(default_factory=dict)  # field -> how its flag's value is written
    # field -> its parser, where its type says too little (the daemon's classes: names and durations)
    parsers: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)

    @property
    def fields(self) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(self.config)}

    def help_texts(self) -> dict[str, str]:
        """Each field's help: its comment in the class's source, or its line of `descriptions`. A ValueError
        names a field that has neither, or a description of no field."""
        comments = source_comments(self.config)
        missing = [name for name in self.fields if name not in comments and name not in self.descriptions]
        stale = [name for name in self.descriptions if name not in self.fields]
        if missing or stale:
            raise ValueError(f"{self.config.__name__}: give each field a comment or a description; none for "
                             f"{missing}, descriptions of no field: {stale}")
        return {name: " ".join(comments[name]) if name in comments else self.descriptions[name]
                for name in self.fields}

    def env_name(self, name: str) -> str:
        return self.env_prefix + name.upper()

    def flag(self, name: str) -> str:
        return "--" + name.replace("_", "-")

    def parser(self) -> argparse.ArgumentParser:
        """The command line: --config and a flag per field (each switch also as --no-<name>)."""
        parser = argparse.ArgumentParser(
            prog=self.prog, description=self.description,
            epilog=f"Every setting also comes from {self.env_prefix}<NAME> in the environment or <name> in the "
                   f"TOML file (--config or ${self.env_prefix}CONFIG): a flag wins over the environment, which "
                   "wins over the file.")
        parser.add_argument("--config", type=Path, metavar="FILE",
                            help="TOML file of settings: the flags' names with _ (an unknown one is refused)")
        helps = self.help_texts()
        for name, f in self.fields.items():
            kind = _kind(f)
            text = (helps[name] + _default_note(f)).replace("%", "%%")
            flags = [self.flag(name)] + ([self.flag(self.aliases[name])] if name in self.aliases else [])
            if kind == "bool":
                parser.add_argument(*flags, dest=name, nargs="?", const="true", default=None,
                                    metavar="true|false", help=text)
                parser.add_argument("--no-" + flags[0][2:], dest=name, action="store_const", const="false",
                                    help=f"the same as {flags[0]}=false")
            elif kind.startswith("dict[") or kind.endswith(", ...]"):  # a list of any length, or a table
                parser.add_argument(*flags, dest=name, action="append", default=None,
                                    metavar=self.metavars.get(name, "K=V,..." if kind.startswith("dict") else "A,..."),
                                    help=text + " (repeatable)")
            else:
                metavar = self.metavars.get(name, _metavar(name, kind))
                parser.add_argument(*flags, dest=name, default=None, metavar=metavar, help=text)
        return parser

    def load(self, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
             fallback: Mapping[str, Any] | None = None) -> T:
        """The config from `argv`, `environ` (the process's own by default) and the TOML file they name, over
        `fallback` (values below the file: another program's variables a setting defaults to). A ValueError
        says what to change; argparse exits on a flag it does not know."""
        return self._build(self.parser().parse_args(argv), environ, fallback)

    def parse(self, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
              fallback: Mapping[str, Any] | None = None) -> T:
        """As `load`, but a bad setting ends the process in one line, as a bad flag does: its message, exit
        status 2 (kvstore/startup.py)."""
        parser = self.parser()
        try:
            return self._build(parser.parse_args(argv), environ, fallback)
        except ValueError as exc:
            exit_at_startup(parser.prog, str(exc))

    def _build(self, args: argparse.Namespace, environ: Mapping[str, str] | None,
               fallback: Mapping[str, Any] | None) -> T:
        environ = os.environ if environ is None else environ
        values = layered(self.fields, args, environ, self.env_prefix)
        values = {**(fallback or {}), **values}
        missing = [name for name, f in self.fields.items() if name not in values
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError("; ".join(f"{name} is required: give {self.flag(name)}, {self.env_name(name)} or "
                                       f"{name} in the config file" for name in missing))
        return self.config(**{name: self.coerce(name, value) for name, value in values.items()})

    def coerce(self, name: str, value: Any) -> Any:
        """`value` (a flag's or a variable's text, or what TOML gave) as field `name` holds it."""
        if name not in self.fields:
            raise ValueError(f"unknown setting {name!r}; known: {', '.join(sorted(self.fields))}")
        kind = _kind(self.fields[name])
        optional = kind.endswith(" | None")
        if optional and (value is None or isinstance(value, str) and value.strip().lower() in _UNSET):
            return None
        try:
            if name in self.parsers:
                return self.parsers[name](value)
            return self._parse(name, kind.removesuffix(" | None"), value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"setting {name}: {exc}") from exc

    def _parse(self, name: str, kind: str, value: Any) -> Any:
        if kind.startswith("tuple["):
            items = _items(value)
            inner = [k.strip() for k in kind[len("tuple["):-1].split(",")]
            # tuple[X, ...]: any number of X; tuple[X, Y]: so many, each of its kind (the config checks the count)
            return tuple(self._parse(name, inner[0] if inner[-1] == "..." else inner[min(i, len(inner) - 1)], item)
                         for i, item in enumerate(items))
        if kind.startswith("dict["):
            entry_kind = kind[len("dict["):-1].split(",", 1)[1].strip()
            pairs: Iterable[tuple[Any, Any]]
            if isinstance(value, Mapping):
                pairs = value.items()
            else:
                pairs = []
                for item in _items(value):
                    key, equals, entry = item.partition("=")
                    if not equals or not key.strip() or not entry.strip():
                        raise ValueError(f"{self.flag(self.aliases.get(name, name))} takes "
                                         f"{self.metavars.get(name, 'KEY=VALUE').removesuffix(',...')}, got {item!r}")
                    pairs.append((key.strip(), entry.strip()))
            return {str(key): self._parse(name, entry_kind, entry) for key, entry in pairs}
        if kind == "bool":
            return boolean(value)
        if kind == "int":
            if unit(name) == "size":
                return parse_size(value)
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError(f"expected a whole number, got {value!r}")
            return int(value)
        if kind == "float":
            if unit(name) == "duration":
                return parse_duration(value)
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(f"expected a number, got {value!r}")
            return float(value)
        if kind in ("str", "Path"):
            if not isinstance(value, (str, Path)):  # a TOML number, list or table where a name or a path belongs
                raise ValueError(f"expected a string, got {value!r}")
            return Path(value) if kind == "Path" else str(value)
        raise TypeError(f"{self.config.__name__}.{name}: no parser for the type {kind!r}")


def layered(fields: Iterable[str], args: argparse.Namespace, environ: Mapping[str, str], env_prefix: str
            ) -> dict[str, Any]:
    """The values the TOML file named by --config (or <env_prefix>CONFIG), then <env_prefix><NAME> variables,
    then the flags give, each over the one before. Repeated flags of a list or a table are joined."""
    fields = list(fields)
    values: dict[str, Any] = {}
    config_path = args.config or environ.get(env_prefix + "CONFIG")
    if config_path:
        try:
            with open(config_path, "rb") as f:
                values.update(tomllib.load(f))
        except FileNotFoundError:
            raise ValueError(f"config file {config_path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {config_path} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise ValueError(f"config file {config_path} cannot be read: {exc.strerror}") from None
        if unknown := sorted(set(values) - set(fields)):
            raise ValueError(f"config file {config_path}: unknown setting {unknown[0]!r}"
                             f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; "
                             f"known: {', '.join(sorted(fields))}")
    for name in fields:
        env_value = environ.get(env_prefix + name.upper())
        if env_value is not None:
            values[name] = env_value
    for name in fields:
        flag = getattr(args, name)
        if flag is not None:
            values[name] = ",".join(flag) if isinstance(flag, list) else flag
    return values


def source_comments(cls: type) -> dict[str, list[str]]:
    """Each field's comment lines in the class's source: the comment lines right above it, then its own."""
    return {name: list(lines) for name, lines in _source_comments(cls).items()}


@functools.cache
def _source_comments(cls: type) -> dict[str, tuple[str, ...]]:
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}  # row -> comment text
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()

    def full_line(row: int) -> bool:
        return row in comments and lines[row - 1].lstrip().startswith("#")

    found: dict[str, tuple[str, ...]] = {}
    (classdef,) = ast.parse(source).body
    assert isinstance(classdef, ast.ClassDef)
    for node in classdef.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above: list[str] = []
            row = node.lineno - 1
            while full_line(row):
                above.insert(0, comments[row])
                row -= 1
            own = [comments[r] for r in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                   if r in comments and not full_line(r)]
            if above or own:
                found[node.target.id] = (*above, *own)
    return found


def _kind(f: dataclasses.Field) -> str:
    """The field's type as written (the configs use `from __future__ import annotations`)."""
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def _items(value: Any) -> list[Any]:
    """A list's items: "a,b" from a flag or a variable, or a TOML list as it is."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"expected a list, got {value!r}")


def _metavar(name: str, kind: str) -> str:
    if unit(name) == "size":
        return "SIZE"
    if unit(name) == "duration":
        return "DURATION"
    base = kind.removesuffix(" | None")
    return {"int": "N", "float": "NUMBER", "Path": "PATH"}.get(base, "TEXT")


def _default_note(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value is dataclasses.MISSING or value is None or value in ((), {}):
        return ""
    if isinstance(value, bool):
        return f" (default: {'on' if value else 'off'})"
    if unit(f.name) == "size" and isinstance(value, int):  # as a size is written: 64GiB, not 68719476736
        return f" (default: {format_size(value)})"
    if unit(f.name) == "duration" and isinstance(value, (int, float)):
        return f" (default: {format_duration(value)})"
    if isinstance(value, dict):
        return f" (default: {','.join(f'{k}={v:g}' if isinstance(v, float) else f'{k}={v}' for k, v in value.items())})"
    return f" (default: {value})"
