"""The session table: LRU bound, TTL, moves made by the router, saving and restoring."""

from __future__ import annotations

from router.balance.warmup import PromptStore
from router.sessions import SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lru_bound_and_ttl() -> None:
    clock = Clock()
    table = SessionTable(max_sessions=2, ttl_s=10, clock=clock)
    table.put(b"a", "r1")
    table.put(b"b", "r2")
    table.get(b"a")  # a read does not refresh: the last *served* turn does
    table.put(b"c", "r1")
    assert len(table) == 2 and table.get(b"a") is None and table.get(b"b") == "r2"
    clock.now = 10.5
    assert table.get(b"b") is None and len(table) == 1


def test_a_move_is_reported_once_and_keeps_the_expiry() -> None:
    clock = Clock()
    table = SessionTable(max_sessions=10, ttl_s=10, clock=clock)
    table.put(b"s", "hot")
    assert not table.move(b"unknown", "cool", "migration")
    assert table.move(b"s", "cool", "migration")
    assert table.get(b"s") == "cool" and table.moved(b"s") == "migration"
    table.put(b"s", "cool")  # served there: the move is spent
    assert table.moved(b"s") is None
    clock.now = 11
    assert not table.move(b"s", "hot", "migration")  # expired sessions are not moved


def test_sessions_on_a_replica_and_save_restore() -> None:
    clock = Clock()
    table = SessionTable(max_sessions=10, ttl_s=10, clock=clock)
    table.put(b"a", "r1")
    clock.now = 4
    table.put(b"b", "r2")
    table.put(b"c", "r1")
    assert [key for key, *_ in table.live("r1")] == [b"a", b"c"]
    saved = [(key, replica, left) for key, replica, left, _ in table.live()]
    assert saved == [(b"a", "r1", 6.0), (b"b", "r2", 10.0), (b"c", "r1", 10.0)]
    other = SessionTable(max_sessions=2, ttl_s=5, clock=Clock())
    for key, replica, left in saved:
        other.restore(key, replica, left)
    assert len(other) == 2 and other.get(b"a") is None  # bounded like any other table
    assert other.get(b"c") == "r1" and other.live()[-1][2] == 5.0  # capped at the TTL


def test_a_move_made_elsewhere_is_placed_with_its_reason_and_listed() -> None:
    clock = Clock()
    table = SessionTable(max_sessions=10, ttl_s=10, clock=clock)
    table.put(b"a", "r1")
    table.place(b"b", "r2", "drain", seconds_left=30, written_ms=1234)  # capped at the TTL
    table.place(b"c", "r2", "drain", seconds_left=0, written_ms=1234)  # already over: not entered
    assert table.get(b"b") == "r2" and table.moved(b"b") == "drain" and table.written_ms(b"b") == 1234
    assert table.get(b"c") is None
    assert table.move(b"a", "r3", "migration", written_ms=99) and table.written_ms(b"a") == 99
    clock.now = 4
    assert table.live() == [(b"a", "r3", 6.0, 99), (b"b", "r2", 6.0, 1234)]
    assert table.live("r2") == [(b"b", "r2", 6.0, 1234)]
    clock.now = 11
    assert table.live() == []


def test_expired_sessions_are_forgotten_as_new_ones_come() -> None:
    clock = Clock()
    table = SessionTable(max_sessions=1_000_000, ttl_s=10, clock=clock)
    store = PromptStore(max_bytes=1 << 30, ttl_s=10, clock=clock)
    body = b'{"messages": []}' + b" " * 1000
    for second in range(100):  # ten new sessions a second for 100 s, each seen once
        clock.now = float(second)
        for i in range(10):
            key = f"s{second}-{i}".encode()
            table.put(key, "r1")
            store.put(key, "/v1/chat/completions", body)
    # only the sessions of the last TTL are held, far below either bound
    assert len(table) <= 110 and len(store) <= 110
    assert store.bytes == sum(len(store.get(k)[1]) for k, *_ in table.live())  # type: ignore[index]
    assert table.get(b"s99-0") == "r1" and store.get(b"s99-0") is not None
    assert table.get(b"s50-0") is None and store.get(b"s50-0") is None
