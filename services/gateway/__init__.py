"""The OpenAI-compatible HTTP gateway: request models, the app, SSE."""
