"""kvstore: a tiered, sharded, verified KV-cache block store for LLM inference."""

from kvstore.block import Block, KVLayout, Namespace, NamespaceMismatch

__all__ = ["Block", "KVLayout", "Namespace", "NamespaceMismatch"]
__version__ = "0.1.0"
