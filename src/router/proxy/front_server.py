"""The front's server: the protocol factory aiohttp's sites listen with, and the runner that makes it.

`FrontRunner` is aiohttp's `web.AppRunner` whose sites listen with a `FrontServer` when the
application has a proxy (router.proxy.front.PROXY) and `front` is on: a `Front` (router.proxy.front)
per client connection, aiohttp's own server for the connections handed over to it, and every
`SWEEP_S` a sweep of the connections' time-outs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

from router.config import RouterConfig
from router.config.groups import ProxySettings
from router.proxy.front import PROXY, SWEEP_S, Front, Serving
from router.routing.request import Keys


class FrontServer:
    """The protocol factory aiohttp's sites listen with: a `Front` per connection, aiohttp's own
    server (`inner`) for the connections handed to it. It stands in for `web.Server` (its
    connections, `pre_shutdown` and `shutdown` count both kinds)."""

    def __init__(
        self, inner: web.Server, proxy: Serving, cfg: ProxySettings, keys: Keys, closing: Callable[[], bool]
    ) -> None:
        """`cfg`: the limits requests are taken in within; `keys`: how their routing keys are read."""
        self.inner = inner
        self.proxy = proxy
        self.cfg = cfg
        self.keys = keys
        self.closing = closing
        self.loop = asyncio.get_running_loop()
        self.fronts: set[Front] = set()
        self.field_size = max(cfg.max_header_bytes + 1024, 8190)
        self.max_headers = max(128, (2 << 20) // self.field_size)
        self.sweeper: asyncio.TimerHandle | None = self.loop.call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        now = self.loop.time()
        for front in list(self.fronts):
            front.sweep(now)
        self.sweeper = self.loop.call_later(SWEEP_S, self._sweep)

    def __call__(self) -> Front:
        return Front(self)

    @property
    def connections(self) -> list[Any]:
        return [*self.inner.connections, *self.fronts]

    @property
    def requests_count(self) -> int:
        return self.inner.requests_count

    def pre_shutdown(self) -> None:
        self.inner.pre_shutdown()
        for front in list(self.fronts):
            front.close_if_idle()

    async def shutdown(self, timeout: float | None = None) -> None:
        await asyncio.gather(self.inner.shutdown(timeout), *(f.finish(timeout) for f in list(self.fronts)))
        self.fronts.clear()
        if self.sweeper is not None:
            self.sweeper.cancel()
            self.sweeper = None


class FrontRunner(web.AppRunner):
    """aiohttp's runner, whose sites listen with the front when the application has a proxy (`PROXY`)
    and `cfg.front` is on; otherwise aiohttp's own server, as `web.AppRunner`."""

    def __init__(self, app: web.Application, cfg: RouterConfig, closing: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.cfg = cfg
        self.closing = closing

    async def _make_server(self) -> web.Server:
        inner = await super()._make_server()
        proxy = self.app.get(PROXY)
        if proxy is None or not self.cfg.front:
            return inner
        keys = Keys.of(self.cfg, proxy.prompts)
        return cast(web.Server, FrontServer(inner, proxy, self.cfg.proxying, keys, self.closing))


__all__ = ["FrontRunner", "FrontServer"]
