"""Keyed digests of block keys, for the access log and the daemon's own log lines.

A block key is a capability: whoever knows it can ask for (and, without authentication, delete) the
block. Logs are read by more people than the store trusts, so they carry `blake2b(key, secret)` instead:
stable for one daemon across restarts (so `kvstore analytics log` still sees reuse), useless against
the store, and different on every daemon. The secret is made once, in `<data_dir>/log-digest.key`.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

SECRET_BYTES = 32


class KeyDigest:
    def __init__(self, secret_path: Path) -> None:
        self._secret = _load_or_make(Path(secret_path))

    def __call__(self, key: bytes) -> str:
        """The hex digest standing for `key` in logs: as long as a key, never the key."""
        return hashlib.blake2b(key, key=self._secret, digest_size=len(key) or 16).hexdigest()


def _load_or_make(path: Path) -> bytes:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = path.read_bytes()
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"{path} is damaged ({len(secret)} bytes, expected {SECRET_BYTES}); delete it to make "
                             "a new one (earlier access logs then stop matching later ones)") from None
        return secret
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    return secret
