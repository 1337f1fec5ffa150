"""A small client of etcd's v3 JSON gateway (etcd >= 3.4): ranges, puts under leases, and watches.

The daemons register under a lease and the clients watch the prefix (kvstore/server/registration.py,
kvstore/client/membership.py). The gateway speaks HTTP/1.1 with base64 keys and values
(https://etcd.io/docs/v3.4/dev-guide/api_grpc_gateway/), so neither side needs an etcd package; the
daemon stays free of one more dependency and of a second gRPC stack's versions.

An endpoint is not trusted to be well-behaved: each exchange ends by a deadline however slowly it sends,
an answer is read only up to MAX_ANSWER_BYTES, and an answer of the wrong shape is an EtcdError like an
unreachable endpoint, never another exception. etcd may be reached over TLS, with a client certificate,
and as one of etcd's own users (`EtcdAccess`).
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# The largest answer, or watch message, read: the registry of a large cluster (1,024 daemons, about
# 200 bytes each) is a few hundred KiB, and no endpoint can make a process hold more than this.
MAX_ANSWER_BYTES = 4 * 2**20

_TOKEN = re.compile(r"[\x21-\x7e]+")  # etcd's auth token goes into a header line: printable, no spaces


class EtcdError(Exception):
    """etcd could not be reached, refused the request, or answered something that is not an answer."""


class _Unauthenticated(EtcdError):
    """etcd refused the auth token (etcd's simple tokens end 5 minutes after their last use)."""


@dataclass(frozen=True, slots=True)
class EtcdAccess:
    """How to reach a secured etcd: over TLS (`ca` set), with a client certificate where etcd requires one,
    and as one of etcd's users (`user` set: its password is traded for a token sent with every call)."""

    ca: str | None = None  # PEM CA bundle that signed etcd's server certificates
    cert: str | None = None  # PEM client certificate and key (etcd --client-cert-auth)
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def tls(self) -> ssl.SSLContext | None:
        if self.ca is None:
            return None
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert is not None:
            context.load_cert_chain(self.cert, self.key)
        return context


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
    """A key or value of an answer; ValueError or TypeError where it is not base64 of UTF-8 text."""
    if not isinstance(data, str):
        raise TypeError(f"expected a base64 string, got {type(data).__name__}")
    return base64.b64decode(data, validate=True).decode()


def prefix_end(prefix: str) -> str:
    """The first key after every key that starts with `prefix` (etcd's range_end for a prefix)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


@contextmanager
def _reading(what: str) -> Iterator[None]:
    """Taking fields out of an answer: one missing or of the wrong kind makes the answer etcd's error."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EtcdError(f"etcd answered {what} with something else: {exc!r}") from exc


class Etcd:
    """Calls to the first endpoint that answers. Each request to an endpoint has `timeout_s` for the whole
    exchange (connect, TLS, request, answer), so however slowly endpoints send, a call ends within
    len(endpoints) x timeout_s (twice or three times that with an etcd user, when it logs in again)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0, access: EtcdAccess | None = None) -> None:
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self.access = access or EtcdAccess()
        self._tls = self.access.tls()
        self._token: str | None = None  # etcd's auth token for `access.user`, got again when etcd refuses it
        self._watching: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, path: str, body: dict) -> dict:
        """POST `body` to `path`: etcd's answer, a JSON object; EtcdError otherwise."""
        if self.access.user is None:
            return self._post(path, body, None)
        try:
            return self._post(path, body, self._token or self._authenticate())
        except _Unauthenticated:
            return self._post(path, body, self._authenticate())

    def _authenticate(self) -> str:
        answer = self._post("/v3/auth/authenticate", {"name": self.access.user, "password": self.access.password},
                            None)
        token = answer.get("token")
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise EtcdError("etcd answered the authentication without a usable token")
        self._token = token
        return token

    def _post(self, path: str, body: dict, token: str | None) -> dict:
        errors = []
        for endpoint in self.endpoints:
            try:
                status, answer = self._exchange(endpoint, path, body, token)
            except (OSError, http.client.HTTPException, ValueError) as exc:  # ssl.SSLError is an OSError
                errors.append(f"{endpoint}: {exc!r}")
                continue
            if status == 401 and token is not None:
                raise _Unauthenticated(f"etcd {endpoint}{path}: {answer.get('message') or 'unauthenticated'}")
            if status != 200 or "error" in answer:
                why = answer.get("message") or answer.get("error") or status
                raise EtcdError(f"etcd {endpoint}{path}: {why}")
            return answer
        raise EtcdError("no etcd endpoint answered: " + "; ".join(errors))

    def _exchange(self, endpoint: str, path: str, body: dict, token: str | None) -> tuple[int, dict]:
        """One request to one endpoint: the status and the answer, an object (ValueError if it is not)."""
        deadline = time.monotonic() + self.timeout_s
        with self._connect(endpoint, deadline) as sock:
            response = _send(_Reader(sock, deadline), endpoint, path, body, token)
            raw = response.read(MAX_ANSWER_BYTES + 1)
        if len(raw) > MAX_ANSWER_BYTES:
            raise ValueError(f"answer larger than {MAX_ANSWER_BYTES} bytes")
        answer = json.loads(raw or b"{}")
        if not isinstance(answer, dict):
            raise ValueError(f"answer is a JSON {type(answer).__name__}, not an object")
        return response.status, answer

    def _connect(self, endpoint: str, deadline: float) -> socket.socket:
        host, _, port = endpoint.rpartition(":")
        host = host.strip("[]")
        sock = socket.create_connection((host, int(port)), timeout=_left(deadline))
        if self._tls is None:
            return sock
        try:
            sock = self._tls.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
            sock.setblocking(False)  # the handshake in steps, each waiting only what is left of the deadline
            while True:
                try:
                    sock.do_handshake()
                    return sock
                except ssl.SSLWantReadError:
                    ready = select.select([sock], [], [], _left(deadline))[0]
                except ssl.SSLWantWriteError:
                    ready = select.select([], [sock], [], _left(deadline))[1]
                if not ready:
                    raise TimeoutError("etcd's TLS handshake passed the deadline")
        except BaseException:
            sock.close()
            raise

    def range_prefix(self, prefix: str) -> tuple[dict[str, str], int]:
        """Every key under `prefix` with its value, and the revision they were read at."""
        answer = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        with _reading("a range"):
            kvs = {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in answer.get("kvs", [])}
            revision = int(answer["header"]["revision"])
            if revision < 0:
                raise ValueError(f"revision {revision}")
        return kvs, revision

    def grant(self, ttl_s: int) -> int:
        answer = self.call("/v3/lease/grant", {"TTL": ttl_s})
        with _reading("a lease grant"):
            return int(answer["ID"])

    def keep_alive(self, lease: int) -> bool:
        """Renew a lease once; False when it has already expired (etcd answers it with no TTL)."""
        answer = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        with _reading("a keepalive"):
            return int(answer.get("result", {}).get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        self.call("/v3/lease/revoke", {"ID": str(lease)})

    def put(self, key: str, value: str, lease: int = 0) -> None:
        self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(lease)})

    def watch(self, prefix: str, start_revision: int,
              idle_s: float | None = None) -> Iterator[list[tuple[str, str, str | None]]]:
        """Batches of changes under `prefix` from `start_revision` on: (kind "PUT"/"DELETE", key, value).

        Blocks while nothing changes, or ends after `idle_s` without a message; ends (or raises EtcdError)
        when the stream breaks or the revision was compacted away, after which the caller reads the range
        again. `cancel()` ends it from another thread. Starting it has the deadline of a call."""
        request = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                      "start_revision": str(start_revision)}}
        if self.access.user is not None and self._token is None:
            self._authenticate()
        for endpoint in self.endpoints:
            deadline = time.monotonic() + self.timeout_s
            try:
                sock = self._connect(endpoint, deadline)
            except OSError:
                continue
            reader = _Reader(sock, deadline)
            try:
                response = _send(reader, endpoint, "/v3/watch", request, self._token)
            except (OSError, http.client.HTTPException):
                sock.close()
                continue
            if response.status != 200:
                sock.close()
                if response.status == 401:
                    self._token = None  # expired: the caller's next range call authenticates again
                raise EtcdError(f"etcd {endpoint} refused the watch: HTTP {response.status}")
            with self._lock:
                self._watching = sock
            try:
                reader.wait(idle_s)  # a quiet membership sends nothing for hours
                yield from _watch_events(response)
            except TimeoutError:
                return  # nothing for idle_s: ended as if by etcd, and the caller reads the range again
            except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise EtcdError(f"etcd watch on {endpoint} broke: {exc!r}") from exc
            finally:
                with self._lock:
                    self._watching = None
                sock.close()
            return
        raise EtcdError(f"no etcd endpoint of {', '.join(self.endpoints)} answered the watch")

    def cancel(self) -> None:
        """End a watch blocked in another thread."""
        with self._lock:
            if self._watching is not None:
                try:
                    self._watching.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("etcd did not answer within the deadline")
    return left


class _Reader(io.RawIOBase):
    """A socket's bytes for http.client, each read waiting only what is left of `deadline`: a server
    that sends a byte now and then cannot hold a call past its deadline. `wait` lifts the deadline
    once a watch has started."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline: float | None = deadline
        self.idle_s: float | None = None

    def wait(self, idle_s: float | None) -> None:
        """From now on, wait up to `idle_s` for each read (None: as long as it takes)."""
        self.deadline, self.idle_s = None, idle_s

    def readable(self) -> bool:
        return True

    def timeout(self) -> float | None:
        """How long the next socket operation may wait."""
        return _left(self.deadline) if self.deadline is not None else self.idle_s

    def readinto(self, buffer) -> int:
        self.sock.settimeout(self.timeout())
        return self.sock.recv_into(buffer)

    def makefile(self, mode: str) -> io.BufferedReader:  # what http.client.HTTPResponse reads through
        return io.BufferedReader(self)


def _send(reader: _Reader, endpoint: str, path: str, body: dict, token: str | None) -> http.client.HTTPResponse:
    """POST `body`; the response with its status and headers read, all by the reader's deadline."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: application/json\r\n" \
           f"Content-Length: {len(data)}\r\n" + (f"Authorization: {token}\r\n" if token else "") + "\r\n"
    reader.sock.settimeout(reader.timeout())
    reader.sock.sendall(head.encode() + data)
    response = http.client.HTTPResponse(reader, method="POST")  # type: ignore[arg-type]
    response.begin()
    return response


def _watch_events(response: http.client.HTTPResponse) -> Iterator[list[tuple[str, str, str | None]]]:
    # One JSON object per line (the gateway streams chunked JSON), each read up to MAX_ANSWER_BYTES.
    while line := response.readline(MAX_ANSWER_BYTES + 1):
        if len(line) > MAX_ANSWER_BYTES:
            raise ValueError(f"a watch message larger than {MAX_ANSWER_BYTES} bytes")
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
