"""Who may do what: bearer tokens scoped to tenants and verbs (docs/design.md section 6, invariant 8).

A token file (TOML) lists the tokens a daemon accepts; it holds SHA-256 digests, never tokens:

    [[tokens]]
    name = "engine-a"                      # shown in logs instead of the token
    sha256 = "9f86d081884c7d65..."         # hex SHA-256 of the token (`kvstore token new` prints both)
    tenants = ["3f1c...", "a07e..."]       # tenant digests (`kvstore tenant SALT`), or ["*"] for all
    verbs = ["read", "write"]              # of read, write, delete, admin

A presented token is hashed and compared with every listed digest in constant time, so neither the
answer's timing nor an early exit tells an attacker how much of a guess was right.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvstore.block import NO_TENANT

VERBS = ("read", "write", "delete", "admin")
ALL_TENANTS = "*"
_TENANT_HEX = 32  # a tenant digest is 16 bytes


class AuthConfigError(ValueError):
    """The token file is missing or malformed; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: its token's name, the tenants it reaches (None: all) and its verbs."""

    name: str
    tenants: frozenset[bytes] | None
    verbs: frozenset[str]

    def may(self, verb: str) -> bool:
        return verb in self.verbs


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token() -> str:
    return "kvs_" + secrets.token_urlsafe(32)


class Authenticator:
    def __init__(self, entries: list[tuple[bytes, Principal]]) -> None:
        self._entries = entries

    @classmethod
    def from_file(cls, path: Path) -> Authenticator:
        try:
            with open(path, "rb") as f:
                document = tomllib.load(f)
        except FileNotFoundError:
            raise AuthConfigError(f"token file {path} does not exist") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise AuthConfigError(f"token file {path} is not readable TOML: {exc}") from None
        tokens = document.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise AuthConfigError(f"token file {path} must list at least one [[tokens]] entry")
        entries, names = [], set()
        for number, item in enumerate(tokens, 1):
            where = f"token file {path}, entry {number}"
            if not isinstance(item, dict):
                raise AuthConfigError(f"{where}: expected a table")
            digest, principal = _entry(item, where)
            if principal.name in names:
                raise AuthConfigError(f"{where}: the name {principal.name!r} is used twice")
            if any(digest == known for known, _ in entries):
                raise AuthConfigError(f"{where} ({principal.name}): the same token as an earlier entry; one "
                                      "token, one entry (a rotation replaces the entry)")
            names.add(principal.name)
            entries.append((digest, principal))
        return cls(entries)

    def authenticate(self, token: str | None) -> Principal | None:
        """The principal of `token`, or None. Every entry is compared, whatever matched first."""
        if not token:
            return None
        presented = token_digest(token)
        found = None
        for digest, principal in self._entries:
            if hmac.compare_digest(presented, digest) and found is None:
                found = principal
        return found


def _entry(item: dict, where: str) -> tuple[bytes, Principal]:
    unknown = set(item) - {"name", "sha256", "tenants", "verbs"}
    if unknown:
        raise AuthConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: name, sha256, tenants, verbs")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise AuthConfigError(f"{where}: needs a non-empty name")
    try:
        digest = bytes.fromhex(str(item.get("sha256", "")))
    except ValueError:
        digest = b""
    if len(digest) != 32:
        raise AuthConfigError(f"{where} ({name}): sha256 must be the 64-hex-digit SHA-256 of the token")
    verbs = item.get("verbs")
    if not isinstance(verbs, list) or not verbs or any(v not in VERBS for v in verbs):
        raise AuthConfigError(f"{where} ({name}): verbs must list some of {', '.join(VERBS)}, got {verbs!r}")
    tenants = item.get("tenants")
    if not isinstance(tenants, list) or not tenants:
        raise AuthConfigError(f"{where} ({name}): tenants must list tenant digests, or ['*'] for all")
    if ALL_TENANTS in tenants:
        if len(tenants) != 1:
            raise AuthConfigError(f"{where} ({name}): '*' stands alone in tenants")
        scope = None
    else:
        scope = frozenset(_tenant(t, where, name) for t in tenants)
    return digest, Principal(name, scope, frozenset(verbs))


def _tenant(text: object, where: str, name: str) -> bytes:
    try:
        tenant = bytes.fromhex(str(text))
    except ValueError:
        tenant = b""
    if len(tenant) * 2 != _TENANT_HEX:
        raise AuthConfigError(f"{where} ({name}): {text!r} is not a tenant digest ({_TENANT_HEX} hex digits; "
                              "`kvstore tenant SALT` prints one)")
    if tenant == NO_TENANT:
        raise AuthConfigError(f"{where} ({name}): the all-zero digest is no tenant (it marks records written "
                              "before records named one); `kvstore tenant SALT` prints a tenant's digest")
    return tenant


def bearer(metadata) -> str | None:
    """The token of an `authorization: Bearer <token>` entry in gRPC metadata, if any."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def token_entry(name: str, token: str, tenants: list[bytes] | None, verbs: list[str]) -> str:
    """The TOML entry of a token file that accepts `token` (`kvstore token new` prints it)."""
    listed = [ALL_TENANTS] if tenants is None else [t.hex() for t in tenants]
    # A TOML array of strings is written like a JSON one.
    return (f"[[tokens]]\nname = {json.dumps(name)}\nsha256 = \"{token_digest(token).hex()}\"\n"
            f"tenants = {json.dumps(listed)}\nverbs = {json.dumps(verbs)}\n")
