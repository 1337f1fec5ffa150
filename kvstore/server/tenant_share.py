"""Each tenant's bytes and recency, for `tenant_max_share` (docs/operations.md, "Limits").

The eviction policy ranks every block of the store together, so without a bound one tenant writing blocks
it never reads evicts every other tenant's. With a share below 1, a tenant past `share` of the budget
loses its own least recently used blocks, whatever the policy thinks of them, before anyone else's.
With the default share of 1 nothing is tracked.
"""

from __future__ import annotations

from collections import OrderedDict


class TenantShare:
    def __init__(self, share: float) -> None:
        self.share = share
        self.enabled = share < 1
        self._bytes: dict[int, int] = {}
        self._recency: dict[int, OrderedDict[bytes, int]] = {}  # tenant id -> key -> record bytes, oldest first

    def added(self, tenant_id: int, key: bytes, nbytes: int) -> None:
        if self.enabled:  # a key added again without a removal between keeps its place in the order
            blocks = self._recency.setdefault(tenant_id, OrderedDict())
            self._bytes[tenant_id] = self._bytes.get(tenant_id, 0) + nbytes - blocks.get(key, 0)
            blocks[key] = nbytes

    def removed(self, tenant_id: int, key: bytes) -> None:
        if self.enabled and (blocks := self._recency.get(tenant_id)) is not None and key in blocks:
            self._bytes[tenant_id] -= blocks.pop(key)

    def accessed(self, tenant_id: int, key: bytes) -> None:
        if self.enabled and (blocks := self._recency.get(tenant_id)) is not None and key in blocks:
            blocks.move_to_end(key)

    def tenants(self) -> list[int]:
        return list(self._recency)

    def bytes_of(self, tenant_id: int) -> int:
        return self._bytes.get(tenant_id, 0)

    def victims(self, tenant_id: int, limit_bytes: int) -> list[bytes]:
        """The tenant's oldest blocks that must go for it to fit in its share of `limit_bytes`."""
        excess = self.bytes_of(tenant_id) - int(self.share * limit_bytes)
        chosen: list[bytes] = []
        for key, nbytes in self._recency.get(tenant_id, {}).items():
            if excess <= 0:
                break
            chosen.append(key)
            excess -= nbytes
        return chosen
