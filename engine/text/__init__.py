"""Text in and out of token ids: chat messages to prompt ids (`chat_prompt`), the check of a prompt's ids
(`token_ids`), and the real-text sessions the demo, tests and benchmarks run (`real_text`)."""
