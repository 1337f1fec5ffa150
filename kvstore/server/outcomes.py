"""What the block store answers, in its own terms: the transports say it in the protocol's (protocol_map.py).

Plain enums, not integers: one that reached a protobuf message untranslated would be refused there, not
sent as whatever protocol value shares its number.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PutResult(enum.Enum):
    STORED = enum.auto()  # the record is stored (or, under another tenant's key, answered as if it were)
    EXISTS = enum.auto()  # a live copy was stored already; its retention was extended


class MissStatus(enum.Enum):
    """Why a block was not served."""

    MISSING = enum.auto()  # no such block (or another tenant's: as good as absent)
    EXPIRED = enum.auto()
    CORRUPT = enum.auto()  # failed verification; counted, and its index entry dropped
    UNAVAILABLE = enum.auto()  # its bytes could not be read (I/O error, segment gone); a retry may succeed


@dataclass(slots=True)
class Miss:
    status: MissStatus
    cause: str  # the metrics' and access log's word for it: "missing", "checksum", "io_error", ...
