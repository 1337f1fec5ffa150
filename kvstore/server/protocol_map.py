"""The store's outcomes (outcomes.py) as protocol values: the one place the transports translate them."""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.proto import pb
from kvstore.server.outcomes import MissStatus, PutResult

_PUT_STATUS = {PutResult.STORED: pb.STORED, PutResult.EXISTS: pb.EXISTS}
_PART_STATUS = {MissStatus.MISSING: pb.MISSING, MissStatus.EXPIRED: pb.EXPIRED, MissStatus.CORRUPT: pb.CORRUPT,
                MissStatus.UNAVAILABLE: pb.UNAVAILABLE}


def put_response(results: Iterable[PutResult]) -> pb.PutResponse:
    """The answer to a Put (either transport): each record's status, in the order the records came."""
    return pb.PutResponse(results=[_PUT_STATUS[result] for result in results])


def part_status(status: MissStatus) -> pb.PartStatus:
    """The pb.PartStatus of a block not served."""
    return _PART_STATUS[status]
