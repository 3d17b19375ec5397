"""Client keys: who may use the router's API, and which tenant each request counts against.

Off unless `client_keys_file` names a file. The file holds a hash of each key, never the key:

    [[keys]]
    id = "ci-runner"          # the key's name: logs and metrics say this, never the key
    tenant = "team-a"         # whose use it is
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

(`printf %s "$KEY" | sha256sum` gives the hash.) With client certificates required
(`tls_client_ca_file`, router.tls), an entry may name a certificate instead of a key:

    [[keys]]
    id = "batch-runner"
    tenant = "team-b"
    subject = "batch-runner.team-b"   # the certificate's subject common name (CN)

A request then counts against the tenant its certificate names; one that also brings a valid key
counts as the key's, which must be of the same tenant (else a 400, as for two keys). A tenant may
have a table of its own:

    [[tenants]]
    name = "team-a"
    priority = "interactive"      # its requests' class, and the highest an X-Priority header may ask
    tokens_per_minute = 200000    # prompt and completion tokens (router.tenancy.budgets); absent: no budget
    ttft_target_ms = 1000         # its requests' TTFT target (router.tenancy.admission); absent: the router's

A tenant without one is of the `default` class with no budget. A client sends its key as OpenAI's SDKs do
(`Authorization: Bearer KEY`) or as Anthropic's do (`x-api-key: KEY`): one credential, or the same key
in both. Two `Authorization` headers, two `x-api-key` headers, or the two naming different keys are
refused (`AmbiguousKey`, a 400), never decided by their order: behind an intermediary that adds a
header of its own, a guess would authenticate or bill someone neither side meant. The file is read again
when it changes, at most a second after (a Kubernetes Secret mounted as a volume is swapped by its
kubelet; an edited file is rewritten): new keys work and removed ones stop, without a restart. A
change that does not parse, or leaves no keys (a write under way), keeps the keys in force and
says why, once, on the log; at startup it stops the router instead (`ClientKeysError`, one line).
A file still being written while it is read is read again at the next check.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from router.errors import RouterError

log = logging.getLogger("router.tenancy.clients")

CHECK_EVERY_S = 1.0  # how often a request may look at the file's modification time
HEX = frozenset("0123456789abcdef")
MISSING = (-1, -1, -1)  # the stamp of a file that is not there
SUBJECT = "subject:"  # an entry naming a client certificate is kept under this and its CN (a key's: its hash)
KEY_HEADERS = frozenset({"authorization", "x-api-key"})  # where a client's key comes (never forwarded with keys on)
# The priority classes, highest first (smg's names, and `sheddable`). A request asks for one with
# the X-Priority header (or smg's x-smg-priority); its tenant's class caps what it may ask and is
# what it gets without asking. The overload queue lets the higher through first and makes room by
# turning away the lower; a `sheddable` request never waits: where it would, it is turned away.
PRIORITIES = ("system", "interactive", "default", "bulk", "sheddable")
RANK = {name: rank for rank, name in enumerate(PRIORITIES)}
DEFAULT_RANK = RANK["default"]
SHEDDABLE = RANK["sheddable"]


class ClientKeysError(RouterError, ValueError):
    """The client keys file is missing, unreadable or malformed (the message says where)."""


@dataclass(frozen=True, slots=True)
class Client:
    """Whom a valid key belongs to."""

    tenant: str
    key_id: str
    rank: int = DEFAULT_RANK  # its tenant's priority class (an index into PRIORITIES)
    ttft_target_s: float | None = None  # its tenant's time-to-first-token target (None: the router's)


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant's own table: its priority class and its token budget."""

    name: str
    rank: int = DEFAULT_RANK
    tokens_per_minute: int | None = None  # None: no budget
    ttft_target_s: float | None = None  # None: the router's `ttft_target_ms` (router.tenancy.admission)


class AmbiguousKey(RouterError, ValueError):
    """A request that presents more than one credential (its message says which)."""


Headers = Mapping[str, str] | Iterable[tuple[str, str]]


def presented_key(headers: Headers) -> str | None:
    """The key a request presents: `Authorization: Bearer KEY` or `x-api-key: KEY` (an Authorization
    of another scheme is none). `headers`: a mapping (a multidict's repeated headers count each) or
    (name, value) pairs. AmbiguousKey for a header given twice, or the two naming different keys."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    auth: str | None = None
    api_key: str | None = None
    for name, value in pairs:
        lowered = name.lower()
        if lowered == "authorization":
            if auth is not None:
                raise AmbiguousKey("the request has more than one Authorization header: send one credential")
            auth = value
        elif lowered == "x-api-key":
            if api_key is not None:
                raise AmbiguousKey("the request has more than one x-api-key header: send one credential")
            api_key = value
    bearer = None
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            bearer = value.strip()
    key = api_key.strip() if api_key and api_key.strip() else None
    if bearer is not None and key is not None and bearer != key:
        raise AmbiguousKey("Authorization and x-api-key name different keys: send one credential")
    return bearer or key


def _tenants(entries: object, where: str) -> dict[str, Tenant]:
    if not isinstance(entries, list):
        raise ClientKeysError(f"{where}: `tenants` must be [[tenants]] entries")
    tenants: dict[str, Tenant] = {}
    for n, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise ClientKeysError(f"{where}: tenant entry {n} is not a table")
        extra = sorted(set(entry) - {"name", "priority", "tokens_per_minute", "ttft_target_ms"})
        if extra:
            raise ClientKeysError(
                f"{where}: tenant entry {n}: unknown field {extra[0]!r} "
                "(name, priority, tokens_per_minute, ttft_target_ms)"
            )
        name, priority, budget = entry.get("name"), entry.get("priority", "default"), entry.get("tokens_per_minute")
        if not isinstance(name, str) or not name.strip() or name.strip() == "none":
            raise ClientKeysError(f"{where}: tenant entry {n}: `name` must be a non-empty string (not `none`)")
        name = name.strip()
        if name in tenants:
            raise ClientKeysError(f"{where}: tenant entry {n}: the tenant {name!r} has two tables")
        if priority not in RANK:
            raise ClientKeysError(f"{where}: tenant {name}: `priority` must be one of {', '.join(PRIORITIES)}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ClientKeysError(f"{where}: tenant {name}: `tokens_per_minute` must be a positive integer")
        target = entry.get("ttft_target_ms")
        if target is not None and (isinstance(target, bool) or not isinstance(target, int | float) or not target > 0):
            raise ClientKeysError(f"{where}: tenant {name}: `ttft_target_ms` must be a positive number of milliseconds")
        tenants[name] = Tenant(name, RANK[priority], budget, None if target is None else target / 1000)
    return tenants


def parse(text: str, where: str) -> tuple[dict[str, Client], dict[str, Tenant]]:
    """The clients of a keys file's text, by the hex SHA-256 of their keys, and its tenants' tables."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClientKeysError(f"{where}: not TOML: {exc}") from None
    entries = data.get("keys", [])
    unknown = sorted(set(data) - {"keys", "tenants"})
    if unknown:
        raise ClientKeysError(
            f"{where}: unknown table or key {unknown[0]!r} (the file holds [[keys]] and [[tenants]] entries)"
        )
    if not isinstance(entries, list):
        raise ClientKeysError(f"{where}: `keys` must be [[keys]] entries")
    tenants = _tenants(data.get("tenants", []), where)
    clients: dict[str, Client] = {}
    ids: set[str] = set()
    for n, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise ClientKeysError(f"{where}: entry {n} is not a table")
        extra = sorted(set(entry) - {"id", "tenant", "sha256", "subject"})
        if extra:
            raise ClientKeysError(f"{where}: entry {n}: unknown field {extra[0]!r} (id, tenant, sha256 or subject)")
        if "sha256" in entry and "subject" in entry:
            raise ClientKeysError(f"{where}: entry {n}: give `sha256` (a key's hash) or `subject` (a certificate's CN)")
        by_subject = "subject" in entry
        key_id, tenant = entry.get("id"), entry.get("tenant")
        digest = entry.get("subject") if by_subject else entry.get("sha256")
        for name, value in (("id", key_id), ("tenant", tenant), ("subject" if by_subject else "sha256", digest)):
            if not isinstance(value, str) or not value.strip():
                also = " (or `subject`, a client certificate's CN)" if name == "sha256" else ""
                raise ClientKeysError(f"{where}: entry {n}: `{name}` must be a non-empty string{also}")
        assert isinstance(key_id, str) and isinstance(tenant, str) and isinstance(digest, str)
        digest = SUBJECT + digest.strip() if by_subject else digest.strip().lower()
        if not by_subject and (len(digest) != 64 or not set(digest) <= HEX):
            raise ClientKeysError(
                f"{where}: entry {n} ({key_id}): `sha256` must be 64 hex digits, the hash of the key, never the key"
            )
        if "none" in (key_id.strip(), tenant.strip()):
            raise ClientKeysError(f"{where}: entry {n}: `none` is taken (it stands for no key in metrics)")
        if key_id in ids:
            raise ClientKeysError(f"{where}: entry {n}: the id {key_id!r} is used twice")
        if digest in clients:
            what = "certificate subject" if by_subject else "key"
            raise ClientKeysError(f"{where}: entry {n} ({key_id}): the same {what} as {clients[digest].key_id!r}")
        ids.add(key_id)
        table = tenants.get(tenant.strip())
        clients[digest] = (
            Client(tenant.strip(), key_id.strip(), table.rank, table.ttft_target_s)
            if table
            else Client(tenant.strip(), key_id.strip())
        )
    return clients, tenants


class ClientKeys:
    """The keys in force, read from `path` (and again whenever it changes)."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._stamp = self._stat()  # raises ClientKeysError: a router with keys on needs them at once
        self.clients, self.tenants = self._read()
        self._checked = clock()
        self._refused: tuple[int, int, int] | None = None  # a version of the file refused (said once)
        self.reloads = 0  # times a change was taken in
        self.rejected = 0  # times a change was refused (the keys before it stay in force)
        self.changed: list[Callable[[], None]] = []  # told after a change is taken in (budgets follow it)

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)  # follows links: a Secret volume swaps its ..data link
        except OSError as exc:
            raise ClientKeysError(f"client_keys_file {self.path}: {exc.strerror or exc}") from None
        return (st.st_mtime_ns, st.st_ino, st.st_size)

    def _read(self) -> tuple[dict[str, Client], dict[str, Tenant]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ClientKeysError(f"client_keys_file {self.path}: {exc}") from None
        return parse(text, f"client_keys_file {self.path}")

    def refresh(self) -> None:
        """Take in a changed file (checked at most every CHECK_EVERY_S); a change that cannot be
        used is said once and leaves the keys in force."""
        now = self.clock()
        if now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        try:
            stamp = self._stat()
        except ClientKeysError as exc:
            self._refuse(MISSING, exc)
            return
        if stamp == self._stamp or stamp == self._refused:
            return
        try:
            clients, tenants = self._read()
            if self._stat() != stamp:
                return  # written to while it was read: read again at the next check, once it is still
            if not clients:
                # an empty file is far likelier a write under way (truncated first) than an intent
                # to lock every client out: the keys stay; to stop serving clients, stop the router
                raise ClientKeysError(f"client_keys_file {self.path}: no keys in it")
        except ClientKeysError as exc:
            self._refuse(stamp, exc)
            return
        self._stamp, self._refused = stamp, None
        self.clients, self.tenants = clients, tenants
        self.reloads += 1
        for hook in self.changed:
            hook()
        log.warning("router: client keys read again from %s: %d keys", self.path, len(clients))

    def _refuse(self, stamp: tuple[int, int, int], exc: ClientKeysError) -> None:
        if stamp != self._refused:
            self._refused = stamp
            self.rejected += 1
            log.error("router: %s; the keys read before stay in force", exc)

    def client(self, headers: Headers, subject: str | None = None) -> Client | None:
        """Whom the request belongs to: its key's client, else its client certificate's (`subject`:
        the certificate's CN, verified by the TLS handshake); None without either; AmbiguousKey for
        two credentials (`presented_key`), or a key and a certificate naming different clients. A
        key that is no client's counts for nothing beside a certificate (an SDK sends a key of some
        kind whatever it is given)."""
        self.refresh()
        key = presented_key(headers)
        by_cert = self.clients.get(SUBJECT + subject) if subject else None
        if key is None:
            return by_cert
        by_key = self.clients.get(hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest())
        if by_cert is not None and by_key is not None and by_cert.tenant != by_key.tenant:
            raise AmbiguousKey("the API key and the client certificate name different tenants: send one credential")
        return by_key or by_cert

    def budgets(self) -> dict[str, int]:
        """Each tenant's tokens a minute, for those with a budget (router.tenancy.budgets)."""
        return {t.name: t.tokens_per_minute for t in self.tenants.values() if t.tokens_per_minute is not None}


def subject_of(peercert: object) -> str | None:
    """The subject common name (CN) of a verified client certificate (`getpeercert()`'s dict)."""
    if not isinstance(peercert, dict):
        return None
    for rdn in peercert.get("subject", ()):
        for name, value in rdn:
            if name == "commonName" and isinstance(value, str):
                return value
    return None
