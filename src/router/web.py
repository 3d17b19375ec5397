"""What the router's HTTP faces share: the proxy, the admin API and the console answer errors in one shape.

An error's body is shaped by the API at the request's path (router.errors: OpenAI's, or
Anthropic's on `/v1/messages`); this is that body as an aiohttp response, and the JSON content
type every JSON answer carries.
"""

from __future__ import annotations

from aiohttp import web

from router.errors import error_body_for

JSON = {"Content-Type": "application/json"}


def error_response(
    message: str,
    status: int = 400,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> web.Response:
    """An error answer, in the shape of the API at `path` (OpenAI's unless it is Anthropic's)."""
    return web.Response(
        status=status,
        body=error_body_for(path, message, status, code, param),
        content_type="application/json",
        headers=headers,
    )


__all__ = ["JSON", "error_response"]
