"""Sliding-window state: kept in host memory for active sessions (`tier`), rebuilt by bounded replay
when it is gone (`replay`)."""

from engine.swa_replay.replay import begin_replay, default_replay_tokens, worth_replaying
from engine.swa_replay.tier import WindowTier

__all__ = ["WindowTier", "begin_replay", "default_replay_tokens", "worth_replaying"]
