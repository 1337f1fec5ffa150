"""Confidence-scheduled speculative decoding (DSpark): the parts outside the decode step loop.

* `drafter`: an n-gram / prompt-lookup drafter with a raw confidence per proposed token;
* `calibration`: per-position temperatures fitted on the cumulative product, ECE and AUROC;
* `schedule`: the DSpark greedy choice of how many drafts of each request to verify;
* `profile`: SPS(B), target forward steps per second at B verified tokens, measured and cached;
* `verify`: the lossless acceptance rules (greedy match, speculative rejection sampling).
"""
