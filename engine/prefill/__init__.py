"""The prefill engine: a client of the store (see engine.py)."""

from engine.prefill.config import PrefillConfig
from engine.prefill.engine import PrefillEngine
from engine.prefill.request import PATHS, PrefillError, PrefillRequest, PrefillResult

__all__ = ["PATHS", "PrefillConfig", "PrefillEngine", "PrefillError", "PrefillRequest", "PrefillResult"]
