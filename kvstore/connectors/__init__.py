"""Backends that put the store under other engines: each engine's own plug-in interface, one module each.

`identity` turns an engine's own cache keys into block identities and `store` makes every plug-in's client
from its engine's settings; `lmcache` is LMCache's remote storage plug-in, `sglang` SGLang HiCache's
storage backend, `vllm_tier` vLLM's offloading tier and `vllm_connector` vLLM's KV connector. A module
imports its engine only when the engine loads it, and connects to the daemons on first use, so nothing
here is needed to run the store or this project's engines.
"""
