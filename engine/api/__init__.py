"""The HTTP API layer over the prefill and decode engines (OpenAI Chat Completions so far)."""
