"""Sizes and durations as an operator writes them, for the daemon's config and the CLIs alike.

Sizes: plain bytes or a number with a suffix, "512MiB", "1.5GB", "2 TiB" (KiB..TiB are powers of 1024,
kB..TB of 1000; case does not matter). Durations: plain seconds or "90s", "10m", "12h", "3d".
Whitespace around the number and the suffix is allowed; negative values, "nan" and "inf" are not.

This module imports only the standard library, so that a CLI can parse a size without loading the server.
"""

from __future__ import annotations

import argparse
import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

__all__ = ["DURATION_UNITS", "MAX_SIZE", "SIZE_UNITS", "UnitError", "format_duration", "format_size",
           "parse_duration", "parse_size"]

# Suffix as written in messages -> bytes; parse_size matches suffixes whatever their case.
SIZE_UNITS = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_SIZE = 2**63 - 1  # what a signed 64-bit count holds (file offsets, LMDB's map size)

_SIZES = {suffix.lower(): factor for suffix, factor in SIZE_UNITS.items()} | {"": 1}
_DURATIONS = {suffix.lower(): factor for suffix, factor in DURATION_UNITS.items()} | {"": 1}
# A sign (to name a negative value as such), digits with an optional fraction, then letters: "1.5 GiB", "-3d".
_QUANTITY = re.compile(r"\s*([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", re.ASCII)
_SIZE_HELP = ("write bytes, or a number with one of the suffixes " + ", ".join(SIZE_UNITS)
              + " (KiB..TiB are powers of 1024, kB..TB of 1000), e.g. '512MiB', '1.5GB'")
_DURATION_HELP = ("write seconds, or a number with one of the suffixes " + ", ".join(DURATION_UNITS)
                  + " (seconds, minutes, hours, days), e.g. '90s', '12h', '3d'")


def _shown(value: Any) -> str:
    """The value as a message quotes it: its repr, cut short when it is long ("9" * 400)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class UnitError(ValueError, argparse.ArgumentTypeError):
    """A value that is not a size or a duration. A ValueError; being an ArgumentTypeError as well, argparse
    shows its message as is when parse_size or parse_duration is an argument's `type`."""


def _quantity(value: str, units: dict[str, int], what: str, help_text: str) -> tuple[Fraction, int]:
    match = _QUANTITY.fullmatch(value)
    if not match:
        raise UnitError(f"{_shown(value)} is not a {what}; {help_text}")
    sign, number, suffix = match.groups()
    if suffix.lower() not in units:
        raise UnitError(f"{_shown(value)} is not a {what}: unknown suffix {suffix!r}; {help_text}")
    quantity = Fraction(number)
    if sign == "-" and quantity:
        raise UnitError(f"{_shown(value)} is not a {what}: a {what} cannot be negative")
    return quantity, units[suffix.lower()]


def parse_size(value: Any) -> int:
    """Bytes from an int, a float (a TOML number) or a string such as "64MiB"; a fraction of a byte is
    rounded down ("1.5KiB" is 1536, "0.3KiB" 307)."""
    if isinstance(value, bool):  # a TOML true/false is no size, though bool is an int
        raise UnitError(f"{_shown(value)} is not a size; {_SIZE_HELP}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise UnitError(f"{_shown(value)} is not a size; {_SIZE_HELP}")
        if value < 0:
            raise UnitError(f"{_shown(value)} is not a size: a size cannot be negative")
        size = math.floor(value)
    elif isinstance(value, str):
        quantity, factor = _quantity(value, _SIZES, "size", _SIZE_HELP)
        size = math.floor(quantity * factor)  # exact: "12345678901234567890" stays that many bytes
    else:
        raise UnitError(f"{_shown(value)} is not a size; {_SIZE_HELP}")
    if size > MAX_SIZE:
        raise UnitError(f"{_shown(value)} is too large a size; the most is {MAX_SIZE} bytes (8 EiB)")
    return size


def parse_duration(value: Any) -> float:
    """Seconds, as a float, from an int, a float (a TOML number) or a string such as "12h"."""
    if isinstance(value, bool):
        raise UnitError(f"{_shown(value)} is not a duration; {_DURATION_HELP}")
    if isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
        if seconds < 0:
            raise UnitError(f"{_shown(value)} is not a duration: a duration cannot be negative")
    elif isinstance(value, str):
        quantity, factor = _quantity(value, _DURATIONS, "duration", _DURATION_HELP)
        try:
            seconds = float(quantity * factor)
        except OverflowError:  # "9" * 400
            seconds = math.inf
    else:
        raise UnitError(f"{_shown(value)} is not a duration; {_DURATION_HELP}")
    if not math.isfinite(seconds):  # expiry and TTL arithmetic need a number of seconds
        raise UnitError(f"{_shown(value)} is not a finite duration; {_DURATION_HELP}")
    return seconds


def format_size(size: int) -> str:
    """The shortest exact spelling parse_size reads back: "64GiB", "1GB", "1000", "0"."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"{size!r} is not a size in bytes")
    if size:
        # Binary first (the daemon's defaults are), each side from the largest unit down.
        for suffix in ("TiB", "GiB", "MiB", "KiB", "TB", "GB", "MB", "kB"):
            if size % SIZE_UNITS[suffix] == 0:
                return f"{size // SIZE_UNITS[suffix]}{suffix}"
    return str(size)


def format_duration(seconds: float) -> str:
    """The shortest exact spelling parse_duration reads back: "3d", "10m", "90s", "0.5s"."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
        raise ValueError(f"{seconds!r} is not a duration in seconds")
    if seconds and float(seconds).is_integer():
        whole = int(seconds)
        for suffix in ("d", "h", "m"):
            if whole % DURATION_UNITS[suffix] == 0:
                return f"{whole // DURATION_UNITS[suffix]}{suffix}"
        return f"{whole}s"
    if seconds == 0:
        return "0s"
    return f"{Decimal(repr(float(seconds))):f}s"  # positional, as parse_duration reads it: 1e-05 -> "0.00001s"
