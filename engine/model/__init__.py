"""The slim decoder: config, weights, RoPE, paged KV and the forward pass over explicit KV.

`Decoder` runs Llama/Qwen3-, gpt-oss- and Gemma 3-style decoders on chunks of tokens against `RequestKV`
(pages from a `PagePool`, plus a ring per sliding layer); it knows nothing of the store.
"""

from engine.model.config import FULL, SLIDING, ModelConfig
from engine.model.decoder import Chunk, Decoder
from engine.model.kv import KVCapacityError, PagePool, RequestKV, WindowState

__all__ = ["FULL", "SLIDING", "Chunk", "Decoder", "KVCapacityError", "ModelConfig", "PagePool", "RequestKV",
           "WindowState"]
