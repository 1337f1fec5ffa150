"""The slim prefill and decode engines that use the store (DESIGN.md section 8).

Not built yet: later issues add the model, the prefill and decode engines and SWA bounded replay.
"""
