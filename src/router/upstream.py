"""How the router reaches replicas: a pooled client, and a pool-less one to resend on a stale connection."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import aiohttp


@dataclass
class Upstream:
    """How the router reaches replicas: the pooled client, and a pool-less one for resending a
    request whose pooled connection the replica had closed (each told to `on_reconnect`, by URL)."""

    pooled: aiohttp.ClientSession
    fresh: aiohttp.ClientSession
    on_reconnect: Callable[[str], None] = lambda url: None

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], timeout: aiohttp.ClientTimeout
    ) -> aiohttp.ClientResponse:
        try:
            return await self.pooled.post(url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # a connection that could not be made is the replica's fault; one found closed before
            # any answer is most often a pooled one the replica had closed: sent again once, on a
            # new connection (as aiohttp itself does for idempotent methods); a replica that died
            # refuses that one, and the caller tries the next replica
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise
        response = await self.fresh.post(url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
        self.on_reconnect(url)  # counted once the new connection answered: else it is the replica's failure
        return response
