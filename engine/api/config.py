"""The API server's one config, and its command line (`kvstore-api --help`): flags, KVSTORE_API_* variables and
a TOML file, generated from `ApiConfig` as the daemon's are (kvstore/settings.py); each field's comment is its help."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.model.dtype import check_name as check_dtype
from engine.prefill.config import BLOCK_TOKENS
from kvstore.client.config import check_addresses
from kvstore.codec import DEFAULT as DEFAULT_CODEC
from kvstore.codec import codec_named
from kvstore.settings import Command

TRAFFIC_CLASSES = ("chat", "agent")


@dataclass(frozen=True)
class ApiConfig:
    # A model directory (config.json, safetensors weights, tokenizer); none: the packaged Gemma 3 270M,
    # converted on first use
    model: Path | None = None
    model_name: str = "gemma-3-270m"  # what clients name in `model`
    # What weights, activations and KV are computed and stored in: auto (bfloat16 where the CPU multiplies it
    # natively, AVX512-BF16 or AMX; else float32), bfloat16 or float32 (the reference). The store's namespace
    # includes it: engines of different dtypes never share cached blocks
    dtype: str = "auto"
    # The store's daemons (kvstore-server), host:port,... or a dns:///, dns+srv:/// or etcd:// target followed
    # as they change (docs/deployment.md); none: no store, every prompt computed. A secured cluster's token and
    # CA come from KVSTORE_TOKEN, KVSTORE_TLS_CA, ... (docs/operations.md)
    servers: tuple[str, ...] = ()
    # How often the daemons are asked whether they answer: GET /health's "store", and a warning in the log when
    # the store becomes unreachable or comes back (engine/api/store_state.py)
    store_probe_s: float = 5.0
    host: str = "127.0.0.1"  # the address to listen on
    port: int = 8000  # the port to listen on
    # API key -> tenant; the tenant salts its cached blocks, so tenants never share them; none: one open
    # tenant, for loopback use
    api_keys: dict[str, str] = field(default_factory=dict)
    kv_pages: int = 1024  # KV pages the engines hold, of block_tokens each: 65,536 tokens of KV
    # The store client's host-DRAM tier, in bytes: blocks this process read or wrote lately, and those of
    # conversations advised to go on (a reply ending in a tool call), read ahead of their next turn; 0: none
    # (the daemons still promote advised blocks into their DRAM)
    host_tier_bytes: int = 0
    # Tokens per KV page and per stored block; the store's namespace includes it, so every process that shares
    # cached prompts with this one must use the same (engine.prefill.config.BLOCK_TOKENS says why 64)
    block_tokens: int = BLOCK_TOKENS
    # The form cached blocks and window records take in the store: raw, zstd (lossless, 1.4x smaller), int8 (2x)
    # or int4 (3.5x), the last two quantised at the quality docs/performance.md states; part of the namespace
    kv_codec: str = DEFAULT_CODEC
    max_running: int = 32  # sequences decoded at once; more wait for a slot
    # Speculative decoding (DecodeConfig.speculative): n-gram drafts verified on the DSpark schedule, lossless;
    # its SPS profile is measured at the first start on a machine and cached
    speculative: bool = True
    # The SPS profile: a verifying forward's seconds at each B of engine.speculative.profile.GRID (1, 2, 4 ...
    # 192 tokens), as an earlier measurement on this machine gave them (its cached file's "seconds"); none: the
    # cached one, else measured at start-up (a few seconds alone, more on a loaded machine)
    sps_profile: tuple[float, ...] | None = None
    # The prefill's chunk cost model, a,b,c of engine.prefill.cost.ChunkCost, from an earlier fit on this
    # machine as the start-up line prints it; none: fitted at start-up by timing forwards (about 20 s on 2
    # cores, more on a loaded machine)
    chunk_cost: tuple[float, float, float] | None = None
    tokenize_workers: int = 2  # processes encoding prompts off the event loop
    # Responses kept for previous_response_id, per tenant, least recently used out first
    max_stored_responses: int = 10_000
    max_stored_bytes: int = 256 << 20  # ... and their bytes, per tenant
    max_body_bytes: int = 4 << 20  # a request body past it is refused (413) before it is read whole
    # A request body's arrays and objects: nested at most max_json_depth deep (far inside Python's recursion
    # limit, leaving headroom for rendering tools and templates) and each holding at most max_array_items
    # entries (messages, input items, content blocks, tools...), so a body's parse stays short; past them, 400
    max_json_depth: int = 64
    max_array_items: int = 4096  # entries of one array or object of a request body; past it, 400
    # Keys (the operator's, not a tenant's) that read every tenant's counts at GET /metrics; a tenant's key
    # reads its own counts and the server's gauges. Without api_keys the one open tenant reads them all
    metrics_keys: tuple[str, ...] = ()
    max_in_flight: int = 128  # requests admitted and not done; past it, 429 (Anthropic: 529)
    max_in_flight_per_tenant: int = 64  # so one tenant cannot take every slot
    # Engine slots (of max_running) one tenant can never take, kept for the others (engine/api/fair.py);
    # none: an eighth of max_running when the API keys name several tenants, else 0
    fair_reserve: int | None = None
    # How long a conversation of each class may idle before the store is advised that it ended: 600 s is
    # about the 95th percentile of the gap between a conversation's turns in the shared trace (chat only;
    # nothing there tells agent gaps apart), so about 4% of such advice is wrong (bench/api_advice.py)
    idle_s: dict[str, float] = field(default_factory=lambda: {"chat": 600.0, "agent": 600.0})
    sweep_interval_s: float = 5.0  # how often idle conversations are looked for
    # What one client may hold of the server's connections (engine/api/connections.py)
    max_connections: int = 2048  # in all; past it a new connection is closed before it is read
    max_connections_per_client: int = 256  # from one client address
    header_timeout_s: float = 10.0  # a request head must arrive whole within this
    write_timeout_s: float = 30.0  # a response its client does not take for this long ends its connection
    # A vision encoder for image parts (engine/vision): the tower's preset, small (224 px, 49 tokens an image) or
    # tiny. Its weights are random, since no trained vision weights ship here: replies about an image mean
    # nothing, while the images' identity in the store, their encoder records and the encoder stage are real.
    # none: a request with an image is refused (400)
    vision: str | None = None
    vision_seed: int = 0  # the seed of the tower's random weights: every process sharing its records uses the same
    # The vision encoder process (python -m engine.vision.server), host:port, with the store's token and CA
    # (KVSTORE_TOKEN, KVSTORE_TLS_CA); none, or while it fails: images the store lacks are encoded here
    vision_encoder: str | None = None
    max_images: int = 8  # image parts in one request; past it, 400
    max_image_bytes: int = 3 << 20  # one image's encoded bytes (max_body_bytes bounds the whole body too); past it, 400
    max_image_pixels: int = 16_777_216  # one image's width x height, read before its pixels are; past it, 400
    # Bytes that images being decoded hold at once over all requests (engine.vision.images.DECODE_BYTES_PER_PIXEL
    # a pixel, charged from the header before decoding); an image that does not fit now is refused with 429.
    # Once decoded, an image keeps only what the vision tower takes (its input size)
    image_decode_bytes: int = 2 << 30
    image_decode_bytes_per_tenant: int = 1 << 30  # ... and by one tenant's requests

    @property
    def reserve(self) -> int:
        """The fair share's reserve in force (see fair_reserve)."""
        if self.fair_reserve is not None:
            return self.fair_reserve
        return self.max_running // 8 if len(set(self.api_keys.values())) > 1 else 0

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("ApiConfig: model_name must be non-empty")
        check_dtype(self.dtype, "ApiConfig")
        codec_named(self.kv_codec, "ApiConfig")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ApiConfig: port must lie in [0, 65535], got {self.port}")
        for name in ("kv_pages", "block_tokens", "max_running", "tokenize_workers", "max_stored_responses",
                     "max_stored_bytes", "max_body_bytes", "max_in_flight", "max_in_flight_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"ApiConfig: {name} must be >= 1")
        if self.host_tier_bytes < 0:
            raise ValueError("ApiConfig: host_tier_bytes must be >= 0 (0: no host tier)")
        if not 8 <= self.max_json_depth <= 256 or self.max_array_items < 1:
            raise ValueError("ApiConfig: max_json_depth must lie in [8, 256] and max_array_items be >= 1")
        if any(not key or key in self.api_keys for key in self.metrics_keys):
            raise ValueError("ApiConfig: metrics_keys are non-empty and none of them a tenant's API key")
        object.__setattr__(self, "metrics_keys", tuple(self.metrics_keys))
        if any(not key or not tenant for key, tenant in self.api_keys.items()):
            raise ValueError("ApiConfig: api_keys maps non-empty keys to non-empty tenant names")
        if set(self.idle_s) - set(TRAFFIC_CLASSES) or any(not v > 0 for v in self.idle_s.values()):
            raise ValueError(f"ApiConfig: idle_s maps traffic classes {TRAFFIC_CLASSES} to seconds > 0")
        if self.chunk_cost is not None and (len(self.chunk_cost) != 3 or not all(0 <= v < 1e3 for v in self.chunk_cost)
                                            or not self.chunk_cost[0] + self.chunk_cost[1] > 0):
            raise ValueError(f"ApiConfig: chunk_cost takes three numbers A,B,C, seconds-coefficients a, b, c >= 0 "
                             f"with a + b > 0, got {self.chunk_cost}")
        if self.sps_profile is not None:
            from engine.speculative.profile import GRID, SpsProfile

            try:
                object.__setattr__(self, "sps_profile", SpsProfile(GRID, tuple(self.sps_profile)).seconds)
            except ValueError as exc:
                raise ValueError(f"ApiConfig: sps_profile takes {len(GRID)} seconds, one per B of {GRID}, "
                                 f"non-decreasing: {exc}") from None
        if self.fair_reserve is not None and not 0 <= self.fair_reserve < self.max_running:
            raise ValueError(f"ApiConfig: fair_reserve must lie in [0, max_running), got {self.fair_reserve}")
        if not 1 <= self.max_connections_per_client <= self.max_connections:
            raise ValueError("ApiConfig: need 1 <= max_connections_per_client <= max_connections")
        if not (self.header_timeout_s > 0 and self.write_timeout_s > 0):
            raise ValueError("ApiConfig: header_timeout_s and write_timeout_s must be > 0")
        if not (self.sweep_interval_s > 0 and self.store_probe_s > 0):
            raise ValueError("ApiConfig: sweep_interval_s and store_probe_s must be > 0")
        if self.vision is not None:
            from engine.vision.presets import VISION_PRESETS

            if self.vision not in VISION_PRESETS:
                raise ValueError(f"ApiConfig: vision must be one of {sorted(VISION_PRESETS)} or none, "
                                 f"got {self.vision!r}")
        if min(self.max_images, self.max_image_bytes, self.max_image_pixels) < 1:
            raise ValueError("ApiConfig: max_images, max_image_bytes and max_image_pixels must be >= 1")
        from engine.vision.images import DECODE_BYTES_PER_PIXEL

        largest = self.max_image_pixels * DECODE_BYTES_PER_PIXEL
        if not largest <= self.image_decode_bytes_per_tenant <= self.image_decode_bytes:
            raise ValueError(f"ApiConfig: need max_image_pixels x {DECODE_BYTES_PER_PIXEL} ({largest}) <= "
                             f"image_decode_bytes_per_tenant ({self.image_decode_bytes_per_tenant}) <= "
                             f"image_decode_bytes ({self.image_decode_bytes}): an image at the pixel limit must "
                             "fit the budget its decode is charged to")
        object.__setattr__(self, "servers", tuple(self.servers))
        check_addresses(self.servers)
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: not a converted model directory (no config.json there); give "
                             "one with config.json, safetensors weights and the tokenizer, or leave --model out "
                             "for the packaged Gemma 3 270M")


COMMAND = Command(ApiConfig, "kvstore-api", "The HTTP API server: OpenAI Chat Completions and Responses, Anthropic "
                  "Messages, over the engines.", "KVSTORE_API_",
                  aliases={"api_keys": "api_key", "metrics_keys": "metrics_key"},
                  metavars={"model": "DIR", "servers": "HOST:PORT,...", "api_keys": "KEY=TENANT",
                            "metrics_keys": "KEY", "chunk_cost": "A,B,C", "sps_profile": "SECONDS,...",
                            "idle_s": "CLASS=DURATION,...", "vision": "PRESET", "vision_encoder": "HOST:PORT"})


def parse_args(argv: Sequence[str] | None = None, prog: str = "kvstore-api",
               environ: Mapping[str, str] | None = None) -> ApiConfig:
    """The config from flags, KVSTORE_API_* variables and the TOML file they name; a bad one exits 2 with its
    message, as a bad flag does."""
    return replace(COMMAND, prog=prog).parse(argv, environ)
