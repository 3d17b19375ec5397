"""Type stubs for the compiled prefix index `_prefix` (see _prefix.pyx; C-level contract in _prefix.pxd)."""

from array import array

from typing_extensions import Buffer

PRICE_CANDIDATE: int  # bits of price's flags_out
PRICE_GATED: int
PRICE_NEAR: int
SPREAD_SMOOTH: float  # price's spread: requests added to the mean (a handful is no imbalance yet)

def block_chain(data: str | Buffer, block_len: int, seed: int = 0) -> array[int]: ...
def chain_of_parts(
    parts: list[str | Buffer] | tuple[str | Buffer, ...], block_len: int, seed: int, mark: int
) -> tuple[array[int], int, int]: ...

class PrefixIndex:
    def __init__(self) -> None: ...
    @property
    def n_holders(self) -> int: ...
    def add_holder(self, capacity: int) -> int: ...
    def remove_holder(self, holder: int) -> None: ...
    def capacity(self, holder: int) -> int: ...
    def set_capacity(self, holder: int, capacity: int) -> int: ...
    def size(self, holder: int) -> int: ...
    def clear(self, holder: int) -> int: ...
    def total(self) -> int: ...
    def memory_bytes(self) -> int: ...
    def insert(self, holder: int, chain: Buffer, n: int = -1, aliases: Buffer | None = None) -> int: ...
    def forget(self, holder: int, aliases: Buffer) -> int: ...
    def key_of(self, holder: int, alias: int) -> int | None: ...
    def match(self, holder: int, chain: Buffer) -> int: ...
    def match_all(self, chain: Buffer, out: Buffer) -> None: ...
    def price(
        self,
        chain: Buffer,
        holders: Buffer,
        busy_until: Buffer,
        seconds_per_token: Buffer,
        loads: Buffer,
        waiting: Buffer,
        caps: Buffer,
        excluded: Buffer,
        now: float,
        decode_s: float,
        mean_uncached: float,
        block_tokens: float,
        total_tokens: float,
        last: int,
        history_blocks: int,
        tie_s: float,
        tie_share: float,
        cached_out: Buffer,
        wait_out: Buffer,
        cost_out: Buffer,
        flags_out: Buffer,
        recent: Buffer | None = None,
        recent_scale: float = 1.0,
        spread_tokens: float = 0.0,
        spread_out: Buffer | None = None,
        interference: float = 0.0,
        history_from_all: bool = False,
        home_share: float = -1.0,
        known: Buffer | None = None,
        spread_whole: bool = False,
        evicts: Buffer | None = None,
    ) -> tuple[int, int, int]: ...
    def truncate(self, holder: int, chain: Buffer, keep: int) -> int: ...
    def evict(self, holder: int, count: int) -> int: ...
