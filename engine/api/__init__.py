"""The HTTP API layer over the prefill and decode engines: OpenAI Chat Completions and Responses, Anthropic Messages."""
