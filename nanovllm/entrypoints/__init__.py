"""Serving nanovllm: the OpenAI-compatible HTTP server, its async front to the engine, metrics and the chat CLI."""
