"""One chat turn through a router, for the integration tests (imported as `chat`)."""

from __future__ import annotations

import aiohttp
import orjson


async def turn(url: str, session: str, content: str | None = None) -> str:
    """Send one short chat turn of `session` (keyed by X-Session-ID); the replica that served it."""
    text = f"hello from {session}" if content is None else content
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers={"X-Session-ID": session}) as r,
    ):
        assert r.status == 200
        return r.headers["X-Router-Replica"]
