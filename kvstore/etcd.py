"""A small client of etcd's v3 JSON gateway (etcd >= 3.4): ranges, puts under leases, and watches.

The daemons register under a lease and the clients watch the prefix (kvstore/server/registration.py,
kvstore/client/membership.py). The gateway speaks HTTP/1.1 with base64 keys and values
(https://etcd.io/docs/v3.4/dev-guide/api_grpc_gateway/), so neither side needs an etcd package; the
daemon stays free of one more dependency and of a second gRPC stack's versions.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit


class EtcdError(Exception):
    """etcd could not be reached or refused the request."""


def parse_url(url: str) -> tuple[tuple[str, ...], str]:
    """`etcd://HOST:PORT[,HOST:PORT...]/PREFIX` -> the endpoints ("host:port") and the key prefix ("/PREFIX/")."""
    parts = urlsplit(url)
    if parts.scheme != "etcd":
        raise ValueError(f"{url!r} is not an etcd://HOST:PORT/PREFIX address")
    endpoints = tuple(e for e in parts.netloc.split(",") if e)
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {endpoint!r} in {url!r} is not host:port")
    prefix = parts.path.strip("/")
    if not endpoints or not prefix:
        raise ValueError(f"{url!r} needs an endpoint and a key prefix: etcd://HOST:2379/kvstore/members")
    return endpoints, f"/{prefix}/"


def _b64(data: str) -> str:
    return base64.b64encode(data.encode()).decode()


def _unb64(data: str) -> str:
    return base64.b64decode(data).decode()


def prefix_end(prefix: str) -> str:
    """The first key after every key that starts with `prefix` (etcd's range_end for a prefix)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


class Etcd:
    """Calls to the first endpoint that answers; every call has a deadline."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self._watching: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def call(self, path: str, body: dict) -> dict:
        errors = []
        for endpoint in self.endpoints:
            connection = http.client.HTTPConnection(endpoint, timeout=self.timeout_s)
            try:
                connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
                response = connection.getresponse()
                answer = json.loads(response.read() or b"{}")
            except (OSError, http.client.HTTPException, ValueError) as exc:
                errors.append(f"{endpoint}: {exc}")
                continue
            finally:
                connection.close()
            if response.status != 200 or "error" in answer:
                why = answer.get("message") or answer.get("error") or response.status
                raise EtcdError(f"etcd {endpoint}{path}: {why}")
            return answer
        raise EtcdError("no etcd endpoint answered: " + "; ".join(errors))

    def range_prefix(self, prefix: str) -> tuple[dict[str, str], int]:
        """Every key under `prefix` with its value, and the revision they were read at."""
        answer = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        kvs = {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in answer.get("kvs", [])}
        return kvs, int(answer["header"]["revision"])

    def grant(self, ttl_s: int) -> int:
        return int(self.call("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def keep_alive(self, lease: int) -> bool:
        """Renew a lease once; False when it has already expired (etcd answers it with no TTL)."""
        return int(self.call("/v3/lease/keepalive", {"ID": str(lease)}).get("result", {}).get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        self.call("/v3/lease/revoke", {"ID": str(lease)})

    def put(self, key: str, value: str, lease: int = 0) -> None:
        self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(lease)})

    def watch(self, prefix: str, start_revision: int) -> Iterator[list[tuple[str, str, str | None]]]:
        """Batches of changes under `prefix` from `start_revision` on: (kind "PUT"/"DELETE", key, value).

        Blocks while nothing changes; ends (or raises EtcdError) when the stream breaks or the revision
        was compacted away, after which the caller reads the range again. `cancel()` ends it from another
        thread."""
        request = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                      "start_revision": str(start_revision)}}
        for endpoint in self.endpoints:
            connection = http.client.HTTPConnection(endpoint, timeout=self.timeout_s)
            try:
                connection.request("POST", "/v3/watch", json.dumps(request), {"Content-Type": "application/json"})
                response = connection.getresponse()
            except (OSError, http.client.HTTPException):
                connection.close()
                continue
            with self._lock:
                self._watching = connection
            try:
                connection.sock.settimeout(None)  # a quiet membership sends nothing for hours
                yield from _watch_events(response)
            except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise EtcdError(f"etcd watch on {endpoint} broke: {exc!r}") from exc
            finally:
                with self._lock:
                    self._watching = None
                connection.close()
            return
        raise EtcdError(f"no etcd endpoint of {', '.join(self.endpoints)} answered the watch")

    def cancel(self) -> None:
        """End a watch blocked in another thread."""
        with self._lock:
            if self._watching is not None and self._watching.sock is not None:
                try:
                    self._watching.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _watch_events(response: http.client.HTTPResponse) -> Iterator[list[tuple[str, str, str | None]]]:
    for line in response:  # one JSON object per line (the gateway streams chunked JSON)
        if not line.strip():
            continue
        message = json.loads(line)
        if "error" in message:  # {"error": "..."} or {"error": {"message": "...", ...}}, by gateway version
            error = message["error"]
            raise EtcdError(f"etcd watch: {error.get('message', error) if isinstance(error, dict) else error}")
        result = message.get("result", {})
        if result.get("compact_revision") or result.get("canceled"):
            return  # the caller re-reads the whole range
        events = [(event.get("type", "PUT"), _unb64(event["kv"]["key"]),
                   _unb64(event["kv"].get("value", "")) if event.get("type", "PUT") == "PUT" else None)
                  for event in result.get("events", [])]
        if events:
            yield events
