"""A daemon's entry in etcd: `PREFIX<advertised address>`, held under a lease it renews.

Clients watching the prefix (kvstore/client/membership.py) see the daemon join once it serves, and
leave when it stops (the lease is revoked) or dies (the lease ends after `register_ttl_s`). etcd being
unreachable never stops the daemon from serving: the entry is retried until etcd answers again.
"""

from __future__ import annotations

import logging
import threading

from kvstore.etcd import Etcd, EtcdAccess, EtcdError, parse_url

log = logging.getLogger(__name__)


class Registration:
    def __init__(self, target: str, advertise: str, ttl_s: float, access: EtcdAccess | None = None) -> None:
        endpoints, prefix = parse_url(target)
        self.etcd = Etcd(endpoints, timeout_s=max(1.0, ttl_s / 4), access=access)
        self.key, self.advertise, self.ttl_s = prefix + advertise, advertise, max(1, round(ttl_s))
        self.lease = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-registration", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        renew_s = self.ttl_s / 3  # two renewals may fail before the lease ends
        while not self._stop.is_set():
            try:
                if not self.lease or not self.etcd.keep_alive(self.lease):
                    self.lease = self.etcd.grant(self.ttl_s)
                    self.etcd.put(self.key, self.advertise, self.lease)
                    log.info("registered as %s in etcd (lease %x, %d s)", self.advertise, self.lease, self.ttl_s)
            except EtcdError as exc:
                log.warning("etcd registration of %s: %s; retrying", self.advertise, exc)
                self._stop.wait(1.0)
                continue
            self._stop.wait(renew_s)

    def stop(self) -> None:
        """Leave at once (clients stop sending work here before the drain), rather than when the lease ends."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        if self.lease:
            try:
                self.etcd.revoke(self.lease)
            except EtcdError as exc:
                log.warning("could not revoke the etcd lease (the entry ends with it in %d s): %s", self.ttl_s, exc)
