"""Routing state that survives a restart: membership changes, drains, vnode overrides, sessions.

Saved as one JSON file, `<directory>/routing-state-<host>-<port>.json`, written atomically (a
temporary file in the same directory, flushed to disk, then renamed over the old one), every few
seconds while something changed and when the router stops. Read back when the router starts:
- replicas added through the admin API come back, and replicas of the configuration that were
  removed through it stay removed (membership = configured - removed + added);
- drains (and a drain's "then remove it") and vnode overrides (rebalancing's moves) are re-applied
  where their replicas exist, and a drain under way goes on;
- replicas that discovery added stay discovery's to remove;
- sessions come back with the time they had left, less the time the router was down.

```json
{"version": 1, "saved_at": 1795968408.9,
 "added": [{"id": "gpu-9", "url": "http://10.0.0.9:8000"}], "removed": ["gpu-3"],
 "draining": ["gpu-4"], "removing": ["gpu-4"], "discovered": [],
 "overrides": [["gpu-0", 17, "gpu-5"]],
 "sessions": [["<base64 key>", "gpu-1", 412.5]]}
```

`Persistence` is the node's part: restore at start, a save loop while it runs, a last save when it stops.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from router.config import ReplicaSpec, shared_through_redis
from router.errors import RouterError
from router.membership import Facts, Membership, Settle
from router.sessions import LinkDown, SessionEntry, SessionTable, SessionView

VERSION = 1
STATE_SAVE_S = 5.0  # how often the routing state is saved while it changes
SESSIONS_SAVE_S = 30.0  # with worker processes: how often their sessions are asked for, to save
log = logging.getLogger("router.state.file")


class StateError(RouterError, ValueError):
    """A state file that cannot be used; str() is one line."""


@dataclass
class RoutingState:
    saved_at: float = 0.0
    added: list[tuple[str, str]] = field(default_factory=list)  # (id, url)
    roles: dict[str, str] = field(default_factory=dict)  # id -> role, of those added where not "both"
    removed: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    removing: list[str] = field(default_factory=list)  # draining replicas that leave once drained
    discovered: list[str] = field(default_factory=list)  # replicas that discovery added (and may remove)
    overrides: list[tuple[str, int, str]] = field(default_factory=list)  # (origin, vnode, owner)
    sessions: list[tuple[bytes, str, float]] = field(default_factory=list)  # (key, replica, seconds left)

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "version": VERSION,
                "saved_at": self.saved_at,
                "added": [
                    {"id": rid, "url": url} | ({"role": self.roles[rid]} if rid in self.roles else {})
                    for rid, url in self.added
                ],
                "removed": self.removed,
                "draining": self.draining,
                "removing": self.removing,
                "discovered": self.discovered,
                "overrides": [list(o) for o in self.overrides],
                "sessions": [[base64.b64encode(k).decode(), r, round(left, 3)] for k, r, left in self.sessions],
            }
        )

    @classmethod
    def from_json(cls, data: bytes) -> RoutingState:
        try:
            raw = orjson.loads(data)
            if not isinstance(raw, dict) or raw.get("version") != VERSION:
                raise StateError(f"not a version-{VERSION} routing state")
            return cls(
                saved_at=float(raw["saved_at"]),
                added=[(str(a["id"]), str(a["url"])) for a in raw["added"]],
                roles={str(a["id"]): str(a["role"]) for a in raw["added"] if "role" in a},
                removed=[str(r) for r in raw["removed"]],
                draining=[str(r) for r in raw["draining"]],
                removing=[str(r) for r in raw.get("removing", ())],
                discovered=[str(r) for r in raw.get("discovered", ())],
                overrides=[(str(o), int(n), str(w)) for o, n, w in raw["overrides"]],
                sessions=[(base64.b64decode(k, validate=True), str(r), float(left)) for k, r, left in raw["sessions"]],
            )
        except StateError:
            raise
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise StateError(f"unreadable routing state ({type(exc).__name__}: {exc})") from None


class StateFile:
    def __init__(self, directory: str, host: str, port: int) -> None:
        self.directory = Path(directory)
        self.path = self.directory / f"routing-state-{host.replace(':', '_')}-{port}.json"

    def load(self) -> RoutingState | None:
        """The saved state, None if there is none yet; StateError if it cannot be read."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        return RoutingState.from_json(data)

    def save(self, state: RoutingState) -> None:
        """Write atomically: readers (and a crash) see the old file or the new one, never half."""
        self.directory.mkdir(parents=True, exist_ok=True)
        data = state.to_json()
        fd, tmp = tempfile.mkstemp(prefix=".routing-state-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def state_file(state: str, host: str, port: int) -> StateFile | None:
    """Where a router with the `state` setting, listening on host:port, keeps its routing state in a
    file (None: Redis, or not kept)."""
    if state == "none" or shared_through_redis(state):
        return None
    directory = state[5:] if state.startswith("file:") else default_directory()
    return StateFile(directory, host, port)


def default_directory() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "kv-affinity-router")


def describe(state: RoutingState) -> dict[str, Any]:
    return {
        "added": len(state.added),
        "removed": len(state.removed),
        "draining": len(state.draining),
        "overrides": len(state.overrides),
        "sessions": len(state.sessions),
    }


class Persistence:
    """A router's routing state in its state file: restored when it starts, saved while it runs."""

    def __init__(self, file: StateFile, membership: Membership, configured: Sequence[ReplicaSpec], view: SessionView):
        self.file = file
        self.membership = membership
        self.configured = configured
        self.view = view
        self.restored: dict[str, int] | None = None  # what the saved state brought back
        self.restored_sessions: list[SessionEntry] = []  # for the workers, once they answer
        self.settle: Settle | None = None  # restored drains, resumed once the balance loop runs
        self._saved_sessions: list[SessionEntry] = []  # the sessions as last asked for ...
        self._sessions_at = -SESSIONS_SAVE_S  # ... then (monotonic seconds)
        self._saved_at: tuple[int, int | None] = (-1, -1)
        self._lock = asyncio.Lock()

    def line(self) -> str:
        """For the start-up banner."""
        line = f"routing state: saved to {self.file.path} (--state none turns it off)"
        if self.restored is not None:
            line += "; restored: " + ", ".join(f"{count} {what}" for what, count in self.restored.items())
        return line

    def restore(self, sessions: SessionTable) -> None:
        """Bring the saved state back (StateError if it cannot be read); a lone router's sessions
        go into `sessions`, a control process's wait for its workers (`restored_sessions`)."""
        saved = self.file.load()
        if saved is None:
            return
        configured = {r.id for r in self.configured}
        facts = Facts(
            replicas={rid: url for rid, url in saved.added},
            roles=saved.roles,
            removed={rid for rid in saved.removed if rid in configured},
            draining={rid: rid in saved.removing for rid in saved.draining},
            overrides={(origin, number): owner for origin, number, owner in saved.overrides},
            discovered=set(saved.discovered),
        )
        self.settle = self.membership.reconcile(facts, everything=False)
        down = max(time.time() - saved.saved_at, 0.0)
        now_ms = int(time.time() * 1000)
        present = {r.id for r in self.membership.fleet.replicas}
        live = [
            (key, replica, left - down, now_ms)
            for key, replica, left in saved.sessions
            if left > down and replica in present  # a replica no longer in the fleet holds nothing to return to
        ]
        if self.view.lone:
            for key, replica, left, written in live:
                sessions.restore(key, replica, left, written)
        else:  # the workers get them when they answer
            self.restored_sessions = live
        self._saved_sessions, self._sessions_at = live, time.monotonic()
        self.restored = describe(saved)
        gone = sum(1 for _, replica, _ in saved.sessions if replica not in present)
        self.restored["sessions"] = len(live)
        if gone:
            self.restored["sessions of replicas no longer in the fleet, dropped"] = gone
        logging.getLogger("router.access").info("routing state restored: %s", self.restored)

    def routing_state(self, sessions: list[SessionEntry]) -> RoutingState:
        membership = self.membership
        fleet = membership.fleet
        configured = {r.id for r in self.configured}
        present = {r.id for r in fleet.replicas}
        return RoutingState(
            saved_at=time.time(),
            added=[(r.id, r.url) for r in fleet.replicas if r.id not in configured],
            roles={r.id: r.role for r in fleet.replicas if r.id not in configured and r.role != "both"},
            removed=[rid for rid in configured if rid not in present],
            draining=[r.id for r in fleet.replicas if r.state == "draining"],
            removing=sorted(membership.removing),
            discovered=sorted(membership.discovered),
            overrides=[(origin, number, owner) for (origin, number), owner in fleet.ring.overrides.items()],
            sessions=[(key, replica, left) for key, replica, left, _ in sessions if left > 0 and replica in present],
        )

    async def save(self, force: bool = False) -> None:
        """Save the routing state if it changed since the last save (or `force`). A lone router
        saves its sessions whenever they changed; with worker processes their sessions are asked
        for every SESSIONS_SAVE_S (and when forced), while a membership change is saved at once
        with the sessions last asked for, their time left counted down since."""
        view = self.view
        source = view.source
        # not while restored sessions wait for the workers: they are the sessions until then
        answering = source is not None and view.ready.is_set() and not self.restored_sessions
        due = time.monotonic() - self._sessions_at >= SESSIONS_SAVE_S
        ask = answering and (view.lone or force or due)
        mark = (self.membership.changes, await source.version() if source is not None and ask else self._saved_at[1])
        if mark == self._saved_at and not force:
            return
        async with self._lock:  # one save at a time: an older snapshot never lands last
            if source is not None and ask:
                with contextlib.suppress(LinkDown):  # no worker answers, and none ever has
                    self._saved_sessions = await source.live()
                    self._sessions_at = time.monotonic()
            aged = time.monotonic() - self._sessions_at
            state = self.routing_state([(k, r, left - aged, w) for k, r, left, w in self._saved_sessions])
            await asyncio.to_thread(self.file.save, state)
            self._saved_at = mark

    async def context(self, app: Any) -> AsyncIterator[None]:
        """The save loop, for `cleanup_ctx`: every STATE_SAVE_S while something changed, and once
        more when the router stops."""
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), STATE_SAVE_S)
                    return  # stopping: the final save follows
                try:
                    await self.save()
                except OSError as exc:
                    log.error("cannot save the routing state: %s", exc)

        task = asyncio.create_task(loop(), name="routing state")
        yield
        stop.set()
        await task  # a save under way finishes first, never cut off in its thread
        try:
            await self.save(force=True)
        except OSError as exc:
            log.error("cannot save the routing state: %s", exc)
