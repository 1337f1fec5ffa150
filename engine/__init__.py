"""The slim model and the engines that use the store (DESIGN.md section 8).

`engine.model.Decoder` runs Llama/Qwen3-style and gpt-oss-style decoders against explicit KV
(`engine.kv`); `engine.prefill` is the prefill engine. The decode engine and SWA bounded replay come
in later issues.
"""
