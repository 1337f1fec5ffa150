"""The engine-embedded client of a kvstore cluster."""

from kvstore.client.client import AsyncKVClient, BlockData, ClientStats, KVClient, PutSummary
from kvstore.client.config import ClientConfig

__all__ = ["AsyncKVClient", "BlockData", "ClientConfig", "ClientStats", "KVClient", "PutSummary"]
