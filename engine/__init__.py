"""The engines that use the store (docs/design.md section 8).

`model`: the slim decoder over explicit paged KV. `checkpoints`: where its weights come from. `text`: chat
prompts and real-text sessions. `prefill`: the prefill engine, a client of the store, with the continuation
record that hands a prompt to another process. `window`: sliding-window state kept in host memory and
rebuilt by bounded replay. `decode`: continuous batching, sampling, routing over instances. `serving`: the
one engine loop behind both front ends. `api`: the OpenAI and Anthropic HTTP API.
"""
