"""OpenAI-compatible HTTP API (Starlette). Never imports torch."""
