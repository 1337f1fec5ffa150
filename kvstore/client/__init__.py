"""The engine-embedded client of a kvstore cluster."""

from kvstore.client.assembly import BlockData
from kvstore.client.client import AsyncKVClient
from kvstore.client.config import ClientConfig
from kvstore.client.stats import ClientStats, PutSummary
from kvstore.client.sync import KVClient

__all__ = ["AsyncKVClient", "BlockData", "ClientConfig", "ClientStats", "KVClient", "PutSummary"]
