"""Protobuf messages of proto/decode.proto, generated at install time (`make proto`)."""

try:
    from engine.serving.proto import decode_pb2 as pb
except ImportError as exc:  # pragma: no cover - a set-up error, not a runtime path
    raise ImportError(
        "engine/serving/proto/decode_pb2.py is missing: generate it with `make proto` (python -m grpc_tools.protoc "
        "-Iproto --python_out=engine/serving/proto proto/decode.proto)"
    ) from exc

SERVICE = "kvstore.decode.v1.DecodeInstance"


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


__all__ = ["pb", "SERVICE", "method"]
