"""Protobuf messages of proto/kvstore.proto, generated at install time (`make proto`)."""

try:
    from kvstore.proto import kvstore_pb2 as pb
except ImportError as exc:  # pragma: no cover - a set-up error, not a runtime path
    raise ImportError(
        "kvstore/proto/kvstore_pb2.py is missing: generate it with `make proto` "
        "(python -m grpc_tools.protoc -Iproto --python_out=kvstore/proto proto/kvstore.proto)"
    ) from exc

SERVICE = "kvstore.v1.KVStore"
KEY_BYTES = 16


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


__all__ = ["pb", "SERVICE", "method"]
