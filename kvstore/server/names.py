"""Traffic classes and tenants by name, the small ids index entries carry for them, and who sees what.

A caller limited to a scope (the tenant digests its token may reach) sees only the blocks of those
tenants: another tenant's block is as good as absent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeGuard

from kvstore.record import NO_TENANT
from kvstore.server.config import ServerConfig
from kvstore.server.index import Entry, Index

Scope = frozenset[bytes] | None  # the tenant digests a caller may reach; None: all (no authentication)


class Names:
    def __init__(self, config: ServerConfig) -> None:
        self._config = config
        self._class_ids: dict[str, int] = {}  # configured class -> its id
        self._class_names: dict[int, str] = {}  # every class id the index knows -> its name
        self._tenant_ids: dict[bytes, int] = {}  # tenant digest -> its id in index entries

    def load(self, index: Index) -> None:
        """The index's ids of the configured traffic classes (assigned on first use), and all names known."""
        for name in self._config.classes:
            self._class_ids[name] = index.class_id(name)
        self._class_names = {v: k for k, v in index.classes().items()}
        self._tenant_ids = index.tenants()

    def class_id(self, name: str) -> int:
        """The id of a configured traffic class (KeyError for another)."""
        return self._class_ids[name]

    def class_known(self, name: str) -> bool:
        return name in self._class_ids

    def class_name(self, class_id: int, unknown: str = "") -> str:
        """The name of a class id (`unknown` if the index never named it)."""
        return self._class_names.get(class_id, unknown)

    def ttl_ms(self, class_id: int) -> int:
        """How long a block of the class is retained after its last use (a class no longer configured: the
        default class's)."""
        config = self._config
        name = self._class_names.get(class_id, config.default_class)
        return int(config.classes.get(name, config.classes[config.default_class]) * 1000)

    def tenant_ids(self, scope: Scope) -> frozenset[int] | None:
        """The index's ids of the tenants in `scope` (None: every tenant, as without authentication)."""
        if scope is None:
            return None
        return frozenset(self._tenant_ids[t] for t in scope if t in self._tenant_ids)

    def visible(self, entry: Entry | None, scope: Scope) -> TypeGuard[Entry]:
        """Whether a caller limited to `scope` may see `entry`; another tenant's block is as good as absent."""
        if entry is None:
            return False
        ids = self.tenant_ids(scope)
        return ids is None or entry.tenant_id in ids

    async def tenant_id(self, tenant: bytes, assign: Callable[[bytes], Awaitable[int]]) -> int:
        """The id of `tenant` (0: a record without one); `assign` commits a new one to the index."""
        if tenant == NO_TENANT:
            return 0
        known = self._tenant_ids.get(tenant)
        if known is None:
            known = self._tenant_ids[tenant] = await assign(tenant)
        return known
