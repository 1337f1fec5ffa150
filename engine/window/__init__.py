"""Sliding-window state: kept in host memory for active sessions (`tier`), rebuilt by bounded replay
when it is gone (`replay`)."""

from engine.window.replay import begin_replay, default_replay_tokens, worth_replaying
from engine.window.tier import WindowTier

__all__ = ["WindowTier", "begin_replay", "default_replay_tokens", "worth_replaying"]
