"""The control process's line to its workers: each worker answers on a private Unix socket.

The requests pass through the workers, so each keeps its own session table, prompt store and
per-vnode traffic counts. The control process runs the balance loop, and asks them here
(`WorkerLink`, a `SessionSource`):

- `GET /traffic`: keyed requests per vnode since the worker started, as `[[origin, vnode, count]]`
  (running totals: the control process takes the differences);
- `POST /live` `{"replica": id | null}`: the worker's live sessions (last served by `replica`),
  as `[[key hex, replica, seconds left, written ms]]`, leaving out those another worker has
  served (or moved) since, as the shared session table says;
- `POST /prompts` `{"keys": [hex]}`: the latest stored request of each, with its expiry, so
  the newest copy among workers wins;
- `POST /move` `{"keys": [hex], "replica": id, "reason": r}`: every worker points its entries
  (and, for the live sessions it has not served, an entry of its own) at the new replica, marked
  with the reason, so whichever worker takes the next turn counts the jump under it;
- `POST /restore` `{"sessions": [...]}`: sessions from the saved routing state (each worker gets
  its share, by key hash, and writes it to the shared table, where all workers find it);
- `GET /version`: changes whenever the worker's session table does;
- `POST /models` `{"models": {replica id: [model] | null}, "adapters": {replica id: [[adapter] |
  null, max_lora | null]}}`: the models each replica serves and the LoRA adapters it has loaded,
  as the control process's probes read them (pinned models still win in the worker); the answer says
  how many requests the worker holds in its admission queue (router.tenancy.admission), which the
  control process's scale signal counts as load.

The sockets live in the control process's private directory (mode 0700), next to its own.
A worker that does not answer within `timeout_s` is left out of that answer, never waited for.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.balance.rebalance import VnodeTraffic
from router.balance.warmup import PromptStore
from router.fleet import Fleet
from router.ring import xxh3_64
from router.routing import SiblingSessions
from router.sessions import LinkDown, SessionEntry, SessionTable

log = logging.getLogger("router.workers")
LINK_TIMEOUT_S = 2.0
TRAFFIC_TIMEOUT_S = 0.5  # the balance loop asks every second: it must not wait long
RESTORE_CHUNK = 20_000


def worker_socket(control_socket: str, index: int) -> str:
    return os.path.join(os.path.dirname(control_socket), f"worker-{index}.sock")


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


def internal_app(
    sessions: SessionTable,
    shared: SiblingSessions | None,
    traffic: VnodeTraffic,
    prompts: PromptStore,
    fleet: Fleet,
    follow: Callable[[], None],
    ttl_s: float,
    held: Callable[[], int] = lambda: 0,
) -> web.Application:
    """A worker's answers to the control process: its session table, the workers' shared one, the
    per-vnode traffic and prompts its balancer keeps; `follow` catches up with the shared replica
    table; `held` is how many requests wait in its admission queue."""

    def newest_elsewhere(key: bytes, replica: str, written: int) -> bool:
        """Another worker served (or moved) this session since we did, to another replica."""
        found = shared.get(key) if shared is not None else None
        return found is not None and found[1] > written and found[0].id != replica

    async def counted(request: web.Request) -> web.Response:
        # running totals since this worker started, never reset here: an answer lost on the way
        # (a time-out) loses no counts, the control process takes the differences
        return _json([[origin, number, count] for (origin, number), count in traffic.recent.items()])

    async def live(request: web.Request) -> web.Response:
        data = orjson.loads(await request.read())
        replica = data.get("replica")
        now, entries = sessions.snapshot()  # at once; the filtering and encoding run in a thread

        def answer() -> bytes:
            return orjson.dumps(
                [
                    [key.hex(), r, expires - now, written]
                    for key, (r, expires, _, written) in entries
                    if expires >= now and (replica is None or r == replica) and not newest_elsewhere(key, r, written)
                ]
            )

        body = await asyncio.to_thread(answer)
        return web.Response(body=body, content_type="application/json")

    async def stored(request: web.Request) -> web.Response:
        data = orjson.loads(await request.read())
        found = []
        for text in data["keys"]:
            entry = prompts.entry(bytes.fromhex(text))
            if entry is not None:
                path, body, expires = entry
                found.append([text, path, base64.b64encode(body).decode(), expires])
        return _json(found)

    async def move(request: web.Request) -> web.Response:
        data = orjson.loads(await request.read())
        follow()  # a replica added a moment ago must be in this worker's view
        target, reason = fleet.find(data["replica"]), data["reason"]
        if target is None or target.index is None:
            return _json([])  # it is not in this worker's view (yet): nothing moves here
        # one time for every worker's entry: none is newer than another's, so each worker's own
        # entry (with its reason) decides there
        written = int(data["written"])
        moved = []
        for text in data["keys"]:
            key = bytes.fromhex(text)
            if not sessions.move(key, target.id, reason, written):
                if shared is None:
                    continue  # not served here, and no other worker's entries to follow
                # the control process moves only live sessions; one another worker served may read
                # as absent while that worker rewrites its entry for this same move (an entry reads
                # empty while it changes): it is placed all the same, as the shared entry will say
                found = shared.get(key)
                left = ttl_s - (written - found[1]) / 1000 if found is not None else ttl_s
                sessions.place(key, target.id, reason, left, written)
            if shared is not None:
                shared.put(key, target, written)
            moved.append([text, written])
        return _json(moved)

    async def restore(request: web.Request) -> web.Response:
        data = orjson.loads(await request.read())
        for text, replica_id, left, written in data["sessions"]:
            key = bytes.fromhex(text)
            found = shared.get(key) if shared is not None else None
            if sessions.get(key) is not None or (found is not None and found[1] >= written):
                continue  # served (or moved) since the router started: that is newer
            sessions.restore(key, replica_id, left, written)
            replica = fleet.find(replica_id)
            if shared is not None and replica is not None:
                shared.put(key, replica, written)
        return _json({"restored": len(data["sessions"])})

    async def models(request: web.Request) -> web.Response:
        data = orjson.loads(await request.read())
        follow()  # a replica added a moment ago must be in this worker's view
        changed = 0
        for rid, names in data["models"].items():
            replica = fleet.find(rid)
            if replica is not None:
                changed += fleet.set_models(replica, frozenset(names) if names else None)
        for rid, (active, max_lora) in data.get("adapters", {}).items():
            replica = fleet.find(rid)
            if replica is not None:
                fleet.set_adapters(replica, frozenset(active) if active is not None else None, max_lora)
        return _json({"changed": changed, "queued": held()})

    async def version(request: web.Request) -> web.Response:
        return _json({"version": sessions.version, "pid": os.getpid()})

    app = web.Application(client_max_size=256 << 20)
    app.router.add_get("/traffic", counted)
    app.router.add_post("/live", live)
    app.router.add_post("/prompts", stored)
    app.router.add_post("/move", move)
    app.router.add_post("/restore", restore)
    app.router.add_get("/version", version)
    app.router.add_post("/models", models)
    return app


class WorkerLink:
    """The control process's `SessionSource`: the workers' answers, merged."""

    def __init__(self, sockets: list[str], timeout_s: float = LINK_TIMEOUT_S) -> None:
        self.sockets = sockets
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clients: list[aiohttp.ClientSession] = []
        # each worker's last whole session list, and when (monotonic): it stands in for a worker
        # that does not answer, so that a save never loses the sessions of a slow or stopped worker
        self._last_live: dict[int, tuple[float, list[Any]]] = {}
        self._traffic_seen: dict[int, dict[tuple[str, int], int]] = {}  # each worker's last running totals
        self._held: dict[int, int] = {}  # each worker's held requests, as it last answered

    def _ensure(self) -> list[aiohttp.ClientSession]:
        if not self._clients:  # made on first use: a client session needs the running loop
            self._clients = [
                aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path), timeout=self.timeout)
                for path in self.sockets
            ]
        return self._clients

    async def close(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            await client.close()

    async def _one(self, index: int, method: str, path: str, payload: Any, timeout_s: float | None = None) -> Any:
        client = self._ensure()[index]
        try:
            body = None if payload is None else orjson.dumps(payload)
            # None would mean no limit at all to aiohttp: the link's own limit unless told otherwise
            timeout = self.timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
            async with client.request(method, "http://worker" + path, data=body, timeout=timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                return orjson.loads(await resp.read())
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
            log.warning("worker %d did not answer %s %s: %s", index, method, path, exc or type(exc).__name__)
            return None

    async def _each(self, method: str, path: str, payload: Any = None, timeout_s: float | None = None) -> list[Any]:
        """Every worker's answer, in worker order; None for one that did not answer."""
        return await asyncio.gather(*(self._one(i, method, path, payload, timeout_s) for i in range(len(self.sockets))))

    async def _all(self, method: str, path: str, payload: Any = None, timeout_s: float | None = None) -> list[Any]:
        return [a for a in await self._each(method, path, payload, timeout_s) if a is not None]

    async def live(self, replica: str | None = None) -> list[SessionEntry]:
        """The workers' live sessions, merged (the newest entry of a key wins). For the whole list,
        a worker that does not answer is represented by its last whole answer (aged); LinkDown if
        no worker has ever answered."""
        newest: dict[bytes, SessionEntry] = {}
        answers = await self._each("POST", "/live", {"replica": replica})
        now = time.monotonic()
        if replica is None:
            for i, answer in enumerate(answers):
                if answer is not None:
                    self._last_live[i] = (now, answer)
                elif i in self._last_live:
                    at, last = self._last_live[i]
                    answers[i] = [[t, r, left - (now - at), w] for t, r, left, w in last if left > now - at]
        if all(a is None for a in answers) and self.sockets:
            raise LinkDown("no worker answered")
        if replica is not None and any(a is None for a in answers):
            # a partial list of one replica's sessions would read as "nothing left there"
            raise LinkDown("a worker did not answer")
        for answer in answers:
            for text, r, left, written in answer or ():
                key = bytes.fromhex(text)
                known = newest.get(key)
                if known is None or written > known[3]:
                    newest[key] = (key, r, float(left), int(written))
        return sorted(newest.values(), key=lambda e: e[3])

    async def prompts(self, keys: list[bytes]) -> dict[bytes, tuple[str, bytes]]:
        best: dict[bytes, tuple[float, str, bytes]] = {}
        if not keys:
            return {}
        for answer in await self._all("POST", "/prompts", {"keys": [k.hex() for k in keys]}):
            for text, path, body, expires in answer:
                key = bytes.fromhex(text)
                if key not in best or expires > best[key][0]:
                    best[key] = (expires, path, base64.b64decode(body))
        return {key: (path, body) for key, (_, path, body) in best.items()}

    async def move(self, keys: list[bytes], replica: str, reason: str) -> list[tuple[bytes, int]]:
        if not keys:
            return []
        moved: dict[bytes, int] = {}
        payload = {"keys": [k.hex() for k in keys], "replica": replica, "reason": reason, "written": time.time() * 1000}
        for answer in await self._all("POST", "/move", payload):
            for text, written in answer:
                key = bytes.fromhex(text)
                moved[key] = max(moved.get(key, 0), int(written))
        return list(moved.items())

    async def restore(self, entries: list[SessionEntry]) -> None:
        """Each worker its share; LinkDown if a share did not get through (a worker skips what it
        has newer, so sending all again is safe)."""
        shares: list[list[list[Any]]] = [[] for _ in self.sockets]
        for key, replica, left, written in entries:
            shares[xxh3_64(key) % len(shares)].append([key.hex(), replica, left, written])
        failed = 0
        for index, share in enumerate(shares):
            for start in range(0, len(share), RESTORE_CHUNK):
                chunk = {"sessions": share[start : start + RESTORE_CHUNK]}
                failed += await self._one(index, "POST", "/restore", chunk) is None
        if failed:
            raise LinkDown(f"{failed} part(s) of the restored sessions did not reach their worker")

    async def traffic(self) -> Counter[tuple[str, int]]:
        """Keyed requests per vnode since the last call: the differences of each worker's running
        totals (a worker that restarted starts from zero; one that did not answer is asked again
        next time, and nothing it counted is lost)."""
        total: Counter[tuple[str, int]] = Counter()
        answers = await self._each("GET", "/traffic", timeout_s=TRAFFIC_TIMEOUT_S)
        for i, answer in enumerate(answers):
            if answer is None:
                continue
            now = {(origin, int(number)): int(count) for origin, number, count in answer}
            before = self._traffic_seen.get(i, {})
            restarted = any(count < before.get(vnode, 0) for vnode, count in now.items()) or len(now) < len(before)
            for vnode, count in now.items():
                grew = count if restarted else count - before.get(vnode, 0)
                if grew > 0:
                    total[vnode] += grew
            self._traffic_seen[i] = now
        return total

    async def models(self, listing: dict[str, list[str] | None], adapters: dict[str, Any] | None = None) -> int:
        """Tell every worker which models each replica serves and which adapters it has loaded; how
        many requests the workers hold in their admission queues (a worker that did not answer
        counts as it last did)."""
        payload = {"models": listing, "adapters": adapters or {}}
        answers = await self._each("POST", "/models", payload, TRAFFIC_TIMEOUT_S)
        for i, answer in enumerate(answers):
            if answer is not None:
                self._held[i] = int(answer.get("queued", 0))
        return sum(self._held.values())

    async def version(self) -> int:
        answers = await self._all("GET", "/version")
        return hash(tuple(sorted((a["pid"], a["version"]) for a in answers)))


async def serve_internal(path: str, app: web.Application) -> web.AppRunner:
    """Serve a worker's internal site (`internal_app`) on `path` (a stale socket file there is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    return runner
