"""One way to configure a process: defaults < TOML file < environment < command-line flags.

Imports only the standard library (and kvstore.units): the daemon, which never imports torch, uses it.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import textwrap
import tokenize
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

_BOOLEANS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _BOOLEANS:
        return _BOOLEANS[value.strip().lower()]
    raise ValueError(f"expected true or false, got {value!r}")


def layered(fields: Iterable[str], argv: Sequence[str] | None, environ: Mapping[str, str], *, prog: str,
            description: str, env_prefix: str) -> dict[str, Any]:
    """The values the TOML file named by --config (or <env_prefix>CONFIG), then <env_prefix><NAME> variables,
    then --<name> flags give, each over the one before."""
    fields = list(fields)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, help="TOML file of settings (same names as the flags, with _)")
    for name in fields:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, metavar="VALUE")
    args = parser.parse_args(argv)

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
    for name in fields:
        env_value = environ.get(env_prefix + name.upper())
        if env_value is not None:
            values[name] = env_value
    for name in fields:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return values


def source_comments(cls: type) -> dict[str, list[str]]:
    """Each field's comment lines in the class's source: the comment lines right above it, then its own."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}  # row -> comment text
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()

    def full_line(row: int) -> bool:
        return row in comments and lines[row - 1].lstrip().startswith("#")

    found: dict[str, list[str]] = {}
    (classdef,) = ast.parse(source).body
    for node in classdef.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, row = [], node.lineno - 1
            while full_line(row):
                above.insert(0, comments[row])
                row -= 1
            own = [comments[r] for r in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                   if r in comments and not full_line(r)]
            if above or own:
                found[node.target.id] = above + own
    return found
