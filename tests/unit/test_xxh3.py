"""XXH3-64 written in this project, checked bit for bit against the xxhash package."""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

SEEDS = [0, 1, 0x9E3779B97F4A7C15, (1 << 64) - 1]


def test_every_length_class_up_to_4096(impl: ModuleType) -> None:
    # 0, 1-3, 4-8, 9-16, 17-128, 129-240 and >240 (several 1024-byte blocks, partial stripes)
    rng = random.Random(20261129)
    blob = rng.randbytes(4096)
    for n in range(4097):
        data = blob[rng.randrange(0, 4096 - n + 1) :][:n]
        seeds = [*SEEDS, rng.getrandbits(64)] if n <= 300 or n % 61 == 0 else [rng.getrandbits(64)]
        for seed in seeds:
            assert impl.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed), (n, seed)


@given(data=st.binary(max_size=2100), seed=st.integers(0, (1 << 64) - 1))
def test_random_inputs_and_seeds(impl: ModuleType, data: bytes, seed: int) -> None:
    assert impl.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed)


@given(text=st.text(max_size=300))
def test_str_is_hashed_as_utf8(impl: ModuleType, text: str) -> None:
    assert impl.xxh3_64(text) == xxhash.xxh3_64_intdigest(text.encode("utf-8"))


def test_buffers_hash_as_their_bytes(impl: ModuleType) -> None:
    data = bytes(range(200))
    expected = xxhash.xxh3_64_intdigest(data, 7)
    assert impl.xxh3_64(bytearray(data), 7) == expected
    assert impl.xxh3_64(memoryview(data), 7) == expected


@pytest.mark.parametrize("bad", [None, 3, 1.5, ["a"]])
def test_non_bytes_keys_are_a_type_error(impl: ModuleType, bad: object) -> None:
    with pytest.raises(TypeError, match="str or bytes-like"):
        impl.xxh3_64(bad)


@pytest.mark.parametrize(("seed", "error"), [(-1, ValueError), (1 << 64, ValueError), ("0", TypeError)])
def test_bad_seeds_are_rejected(impl: ModuleType, seed: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="seed"):
        impl.xxh3_64(b"x", seed)


def test_lone_surrogates_cannot_be_keys(impl: ModuleType) -> None:
    with pytest.raises(UnicodeEncodeError):
        impl.xxh3_64("\udcff")
