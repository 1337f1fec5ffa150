"""Writes deploy/kvstore.toml, the example config that lists every `ServerConfig` field.

    python -m kvstore.server.config_example deploy/kvstore.toml     # rewrite it after changing ServerConfig
    python -m kvstore.server.config_example --check deploy/kvstore.toml

Each setting is written with its default, except the few `DEPLOYMENT` sets as a deployment would (their
default is noted beside them), above a comment taken from the field's own comment in kvstore/server/config.py,
or from `DESCRIPTIONS` for a field that has none there. A new field without either stops the generator;
tests/kvstore/server/test_config_example.py fails while the committed file differs from what this writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

from kvstore.server.config import DEFAULT_CLASSES, DESCRIPTIONS, ServerConfig
from kvstore.settings import source_comments, unit
from kvstore.units import format_duration, format_size

# What the example sets otherwise than the defaults: a daemon on a storage host, reachable by its engines.
DEPLOYMENT: dict[str, Any] = {
    "data_dir": Path("/data"),
    "host": "0.0.0.0",
    "metrics_port": 9100,
    "metrics_host": "0.0.0.0",
    "capacity_bytes": 2**40,
    "hot_tier_bytes": 8 * 2**30,
}


# Values of an optional setting, shown beside it (the file sets them "off": each must name a readable file).
EXAMPLES = {
    "port_file": "/run/kvstore/port",
    "access_log": "/data/access.log",
    "auth_tokens": "/etc/kvstore/tokens.toml",
    "tls_cert": "/etc/kvstore/daemon.pem",
    "tls_key": "/etc/kvstore/daemon.key",
    "tls_client_ca": "/etc/kvstore/clients-ca.pem",
}

CLASS_NOTES = {
    "handoff": "prefill -> decode continuation records (engine/prefill/handoff.py): read once, soon",
    "window": "a session's latest sliding-window state (engine/window/record.py): while it is active",
}

HEADER = """\
# An example kvstore-server config: every setting, with its default unless noted (kvstore-server --config
# deploy/kvstore.toml). Written by `python -m kvstore.server.config_example deploy/kvstore.toml` from ServerConfig
# (kvstore/server/config.py): do not edit it by hand; tests/kvstore/server/test_config_example.py checks it.
# Every setting can also come from KVSTORE_<NAME> in the environment or --<name> on the command line;
# the command line wins over the environment, which wins over this file. "off" unsets an optional setting.
# Sizes are bytes or e.g. "512MiB", "1.5GB"; durations seconds or e.g. "90s", "10m", "12h", "3d" (kvstore/units.py).
# This file is a storage host's: it listens on every address (0.0.0.0, /metrics too, which has no tokens) and
# writes /data with a 1 TiB budget. For one machine, start from deploy/kvstore-loopback.toml instead.\
"""


def descriptions() -> dict[str, list[str]]:
    """Comment lines for every field; a ValueError names the fields that have none."""
    fields = [f.name for f in dataclasses.fields(ServerConfig)]
    from_source = source_comments(ServerConfig)
    problems = [f"{name}: give it a comment in ServerConfig or a line in DESCRIPTIONS"
                for name in fields if name not in from_source and name not in DESCRIPTIONS]
    problems += [f"DESCRIPTIONS[{name!r}]: ServerConfig has no such field" for name in DESCRIPTIONS
                 if name not in fields]
    problems += [f"DESCRIPTIONS[{name!r}]: the field's comment in ServerConfig is used; drop this line"
                 for name in DESCRIPTIONS if name in from_source]
    problems += [f"{table}[{name!r}]: ServerConfig has no such field" for table, names in
                 (("DEPLOYMENT", DEPLOYMENT), ("EXAMPLES", EXAMPLES)) for name in names if name not in fields]
    problems += [f"CLASS_NOTES[{name!r}]: no such default class" for name in CLASS_NOTES if name not in DEFAULT_CLASSES]
    if problems:
        raise ValueError("cannot describe every setting:\n  " + "\n  ".join(problems))
    return {name: from_source.get(name) or [DESCRIPTIONS[name]] for name in fields}


def toml_value(name: str, value: Any) -> str:
    """`value` as the TOML the daemon's loader reads back to it."""
    if value is None:
        return '"off"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if unit(name) == "size":
        text = format_size(value)
        return text if text.isdigit() else json.dumps(text)
    if unit(name) == "duration":
        return json.dumps(format_duration(value))
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    raise TypeError(f"{name}: no TOML spelling for {value!r}")


def default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def settings() -> dict[str, Any]:
    """The values the example sets: the defaults, with DEPLOYMENT's in their place."""
    return {f.name: DEPLOYMENT.get(f.name, default(f)) for f in dataclasses.fields(ServerConfig)}


def render() -> str:
    comments = descriptions()
    out, tables = [HEADER], []
    for field in dataclasses.fields(ServerConfig):
        value = settings()[field.name]
        if isinstance(value, dict):  # a TOML table must follow every plain key
            tables.append(field)
            continue
        out.append("")
        out.extend(f"# {line}" for line in comments[field.name])
        line = f"{field.name} = {toml_value(field.name, value)}"
        notes = []
        if field.name in DEPLOYMENT:
            notes.append(f"default: {toml_value(field.name, default(field))}")
        if field.name in EXAMPLES:
            notes.append(f"e.g. {json.dumps(EXAMPLES[field.name])}")
        out.append(line + ("  # " + "; ".join(notes) if notes else ""))
    for field in tables:
        out.append("")
        out.extend(f"# {line}" for line in comments[field.name])
        out.append(f"[{field.name}]")
        for key, value in settings()[field.name].items():
            # the classes are TTLs; any other table is written as its values are
            text = json.dumps(format_duration(value)) if field.name == "classes" else toml_value(field.name, value)
            note = f"  # {CLASS_NOTES[key]}" if field.name == "classes" and key in CLASS_NOTES else ""
            out.append(f"{key if re.fullmatch(r'[A-Za-z0-9_-]+', key) else json.dumps(key)} = {text}{note}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.server.config_example", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, nargs="?", help="write it here (default: standard output)")
    parser.add_argument("--check", action="store_true", help="exit 1 if PATH differs from what would be written")
    args = parser.parse_args(argv)
    try:
        text = render()
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.check:
        if args.path is None:
            parser.error("--check needs the PATH to compare")
        if not args.path.is_file() or args.path.read_text() != text:
            print(f"{args.path} is not what `python -m kvstore.server.config_example {args.path}` writes; "
                  "run that", file=sys.stderr)
            return 1
        return 0
    if args.path is None:
        sys.stdout.write(text)
    else:
        args.path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
