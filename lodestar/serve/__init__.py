"""HTTP server: OpenAI (chat, completions, responses) and Anthropic (messages) APIs over one engine."""
from lodestar.serve.app import build_app
from lodestar.serve.state import ServeConfig

__all__ = ["build_app", "ServeConfig"]
