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
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

VERSION = 1


class StateError(ValueError):
    """A state file that cannot be used; str() is one line."""


@dataclass
class RoutingState:
    saved_at: float = 0.0
    added: list[tuple[str, str]] = field(default_factory=list)  # (id, url)
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
                "added": [{"id": rid, "url": url} for rid, url in self.added],
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
