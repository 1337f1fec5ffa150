"""The API server's one config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

TRAFFIC_CLASSES = ("chat", "agent")


@dataclass(frozen=True)
class ApiConfig:
    model: Path | None = None  # a model directory (config.json, weights, tokenizer); None: the packaged Gemma 3
    model_name: str = "gemma-3-270m"  # what clients name in `model`
    servers: tuple[str, ...] = ()  # the store's daemons, host:port; none: no store
    host: str = "127.0.0.1"
    port: int = 8000
    # API key -> tenant name (hashed into the namespace salt); empty: one open tenant, for loopback use
    api_keys: dict[str, str] = field(default_factory=dict)
    kv_pages: int = 256
    block_tokens: int = 256
    max_running: int = 32

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("ApiConfig: model_name must be non-empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ApiConfig: port must lie in [0, 65535], got {self.port}")
        for name in ("kv_pages", "block_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"ApiConfig: {name} must be >= 1")
        if any(not key or not tenant for key, tenant in self.api_keys.items()):
            raise ValueError("ApiConfig: api_keys maps non-empty keys to non-empty tenant names")
        object.__setattr__(self, "servers", tuple(self.servers))
