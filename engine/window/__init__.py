"""Sliding-window state: a hybrid model's window as of a block boundary, which no stored block holds.

`tier`: kept in host memory for active sessions. `record`: saved in the store beside the blocks, so that a
restarted engine or another instance resumes exactly. `replay`: rebuilt approximately by bounded replay
when both are gone (`quality` measures how far). `keeper`: one prefill engine's windows, kept in the tier
and as records, and the plan that picks among tier, record and replay for a resumed prefix.
"""

from engine.window.replay import begin_replay, default_replay_tokens, worth_replaying
from engine.window.tier import WindowTier

__all__ = ["WindowTier", "begin_replay", "default_replay_tokens", "worth_replaying"]
