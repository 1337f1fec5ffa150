"""The engine-embedded client of a kvstore cluster.

Engines and engine plug-ins take a StoreClient (the calls they make); KVClient is the one that serves
them, the blocking face of AsyncKVClient."""

from kvstore.client.assembly import BlockData
from kvstore.client.client import AsyncKVClient
from kvstore.client.config import ClientConfig
from kvstore.client.face import StoreClient
from kvstore.client.stats import ClientStats, PutSummary
from kvstore.client.sync import KVClient

__all__ = ["AsyncKVClient", "BlockData", "ClientConfig", "ClientStats", "KVClient", "PutSummary", "StoreClient"]
