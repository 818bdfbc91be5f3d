"""API-key check for ``/v1/*``, ``/api/*``, ``/tokenize``, ``/report`` and ``/metrics`` (``/health``, the web page and the OpenAPI document stay open).

OpenAI routes take ``Authorization: Bearer KEY``; Anthropic routes take ``x-api-key: KEY``
or the Bearer header. CORS preflight requests pass, so browsers can ask first.
"""
from __future__ import annotations

import hmac

from lodestar.serve.errors import APIError, error_response, is_anthropic_path

PROTECTED_PREFIXES = ("/v1/", "/api/", "/tokenize", "/metrics", "/report")


def presented_key(path: str, headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if is_anthropic_path(path):
        return headers.get("x-api-key")
    return None


class APIKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if (scope["type"] == "http" and scope.get("method") != "OPTIONS"
                and (path.startswith(PROTECTED_PREFIXES) or path == "/metrics")):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            key = presented_key(path, headers)
            if key is None or not hmac.compare_digest(key.encode(), self.api_key):
                how = "x-api-key: KEY or Authorization: Bearer KEY" if is_anthropic_path(path) \
                    else "Authorization: Bearer KEY"
                message = "Invalid API key." if key is not None else f"Missing API key: send {how}."
                err = APIError(401, message, code="invalid_api_key",
                               headers={"WWW-Authenticate": 'Bearer realm="lodestar"'})
                await error_response(path, err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
