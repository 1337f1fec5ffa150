"""The decode engine: continuous batching, sampling, same-process handoff from prefill (see engine.py)."""

from engine.decode.config import DecodeConfig
from engine.decode.engine import DecodeEngine
from engine.decode.request import FINISH_REASONS, DecodeError, DecodeRequest, DecodeResult
from engine.decode.sampling import SamplingParams

__all__ = ["DecodeConfig", "DecodeEngine", "DecodeError", "DecodeRequest", "DecodeResult", "FINISH_REASONS",
           "SamplingParams"]
