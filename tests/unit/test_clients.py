"""Client keys (router.tenancy.clients): the file's entries and its mistakes, the key a request presents,
and a file read again when it changes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from multidict import CIMultiDict

from router.proxy.cli import main
from router.proxy.intake import Refused, wishes
from router.tenancy.clients import (
    CHECK_EVERY_S,
    RANK,
    AmbiguousKey,
    Client,
    ClientKeys,
    ClientKeysError,
    parse,
    presented_key,
    subject_of,
)


def entry(key: str, key_id: str, tenant: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f'[[keys]]\nid = "{key_id}"\ntenant = "{tenant}"\nsha256 = "{digest}"\n'


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_the_key_comes_from_a_bearer_token_or_anthropics_header() -> None:
    assert presented_key({"authorization": "Bearer k-1"}) == "k-1"
    assert presented_key({"authorization": "bearer  k-1 "}) == "k-1"
    assert presented_key({"x-api-key": "k-2"}) == "k-2"
    assert presented_key({"authorization": "Basic abc", "x-api-key": "k-3"}) == "k-3"
    assert presented_key({"authorization": "Bearer "}) is None and presented_key({}) is None
    # one key in both headers is one credential; a multidict's and a pair list's headers count each
    assert presented_key(CIMultiDict({"Authorization": "Bearer k-4", "X-Api-Key": "k-4"})) == "k-4"
    assert presented_key([("Authorization", "Basic abc"), ("x-api-key", "k-5")]) == "k-5"


@pytest.mark.parametrize(
    ("headers", "says"),
    [
        ([("Authorization", "Bearer k-1"), ("authorization", "Bearer k-2")], "more than one Authorization"),
        ([("Authorization", "Bearer k-1"), ("Authorization", "Bearer k-1")], "more than one Authorization"),
        ([("Authorization", "Basic abc"), ("Authorization", "Bearer k-1")], "more than one Authorization"),
        ([("x-api-key", "k-1"), ("X-API-KEY", "k-1")], "more than one x-api-key"),
        ([("Authorization", "Bearer k-1"), ("x-api-key", "k-2")], "different keys"),
        ([("x-api-key", "k-2"), ("Authorization", "Bearer k-1")], "different keys"),
    ],
)
def test_two_credentials_are_never_guessed_between(headers: list[tuple[str, str]], says: str) -> None:
    with pytest.raises(AmbiguousKey, match=says):
        presented_key(headers)
    with pytest.raises(AmbiguousKey, match=says):
        presented_key(CIMultiDict(headers))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[[keys]\n", "not TOML"),
        ("[other]\nx = 1\n", "unknown table or key 'other'"),
        ('keys = "a"\n', "[[keys]] entries"),
        ('[[keys]]\nid = "a"\ntenant = "t"\n', "`sha256` must be a non-empty string"),
        ('[[keys]]\nid = "a"\ntenant = "t"\nsha256 = "sk-plain-key"\n', "64 hex digits, the hash of the key"),
        ('[[keys]]\nid = "a"\ntenant = "t"\nsha256 = "' + "0" * 64 + '"\nkey = "x"\n', "unknown field 'key'"),
        (entry("a", "same", "t") + entry("b", "same", "t"), "the id 'same' is used twice"),
        (entry("a", "one", "t") + entry("a", "two", "t"), "the same key as 'one'"),
        (entry("a", "none", "t"), "`none` is taken"),
        ('[[tenants]]\nname = "t"\npriority = "urgent"\n', "`priority` must be one of system, interactive"),
        ('[[tenants]]\nname = "t"\ntokens_per_minute = 0\n', "`tokens_per_minute` must be a positive integer"),
        ('[[tenants]]\nname = "t"\n[[tenants]]\nname = "t"\n', "the tenant 't' has two tables"),
        ('[[tenants]]\nname = "t"\nweight = 2\n', "unknown field 'weight'"),
    ],
)
def test_a_bad_file_is_one_line_that_says_where(text: str, says: str) -> None:
    with pytest.raises(ClientKeysError, match=r"keys\.toml") as caught:
        parse(text, "keys.toml")
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_keys_are_looked_up_by_hash_and_name_their_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(entry("sk-alpha", "ci", "team-a") + entry("sk-beta", "notebook", "team-b"))
    keys = ClientKeys(str(path))
    assert keys.client(CIMultiDict({"Authorization": "Bearer sk-alpha"})) == Client("team-a", "ci")
    assert keys.client({"x-api-key": "sk-beta"}) == Client("team-b", "notebook")
    assert keys.client(CIMultiDict({"AUTHORIZATION": "Bearer sk-gamma"})) is None and keys.client({}) is None
    assert "sk-alpha" not in path.read_text()  # the file holds hashes alone


def test_a_tenants_table_gives_its_keys_a_class_and_a_budget(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    tables = '[[tenants]]\nname = "batch"\npriority = "bulk"\ntokens_per_minute = 6000\n'
    path.write_text(entry("sk-a", "a", "batch") + entry("sk-b", "b", "team-b") + tables)
    keys = ClientKeys(str(path))
    assert keys.client({"x-api-key": "sk-a"}) == Client("batch", "a", RANK["bulk"])
    assert keys.client({"x-api-key": "sk-b"}) == Client("team-b", "b", RANK["default"])  # no table: default
    assert keys.budgets() == {"batch": 6000}


def test_a_changed_file_is_read_again_and_a_broken_change_keeps_the_keys_in_force(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(entry("sk-old", "old", "t"))
    clock = Clock()
    keys = ClientKeys(str(path), clock)
    path.write_text(entry("sk-new", "new", "t"))
    os.utime(path, ns=(1, 2_000_000_000_000_000_000))  # a new modification time, whatever the file system's grain
    assert keys.client({"x-api-key": "sk-old"}) is not None  # not looked at again within the second
    clock.now += CHECK_EVERY_S
    assert keys.client({"x-api-key": "sk-old"}) is None and keys.client({"x-api-key": "sk-new"}) is not None
    assert keys.reloads == 1
    path.write_text("[[keys]\n")  # a half-written edit
    os.utime(path, ns=(1, 3_000_000_000_000_000_000))
    clock.now += CHECK_EVERY_S
    assert keys.client({"x-api-key": "sk-new"}) is not None and keys.rejected == 1
    clock.now += CHECK_EVERY_S
    keys.refresh()
    assert keys.rejected == 1  # said once, not every second
    path.unlink()
    clock.now += CHECK_EVERY_S
    assert keys.client({"x-api-key": "sk-new"}) is not None and keys.rejected == 2  # gone: still the last keys
    path.write_text(entry("sk-back", "back", "t"))
    clock.now += CHECK_EVERY_S
    assert keys.client({"x-api-key": "sk-back"}) == Client("t", "back")
    path.write_text("")  # an editor's write under way: truncated first
    os.utime(path, ns=(1, 4_000_000_000_000_000_000))
    clock.now += CHECK_EVERY_S
    assert keys.client({"x-api-key": "sk-back"}) is not None and keys.rejected == 3  # not every key dropped


def test_a_missing_or_broken_file_stops_the_router_at_startup(tmp_path: Path) -> None:
    with pytest.raises(ClientKeysError, match="No such file"):
        ClientKeys(str(tmp_path / "absent.toml"))
    broken = tmp_path / "broken.toml"
    broken.write_text('[[keys]]\nid = "a"\n')
    with pytest.raises(ClientKeysError, match="`tenant` must be a non-empty string"):
        ClientKeys(str(broken))


def test_router_serve_reads_the_keys_file_before_it_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(entry("sk-1", "ci", "team-a") + entry("sk-2", "nb", "team-a"))
    base = [
        "--replica",
        "r0=http://127.0.0.1:9",
        "--admin-token",
        "tttttttttttttttt",
        "--state",
        "none",
        "--check-config",
    ]
    assert main([*base, "--client-keys-file", str(path)]) == 0
    assert f"client keys: 2 keys of 1 tenant in {path}" in capsys.readouterr().out
    assert main([*base, "--client-keys-file", str(tmp_path / "absent.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("router-serve: client_keys_file") and err.count("\n") == 1


def test_a_file_written_while_it_is_read_is_read_again_once_it_is_still(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(entry("sk-1", "one", "t"))
    clock = Clock()
    keys = ClientKeys(str(path), clock)
    read = keys._read

    def read_while_written() -> dict[str, Client]:
        found = read()  # half of a two-step write, say
        path.write_text(entry("sk-1", "one", "t") + entry("sk-2", "two", "t"))
        os.utime(path, ns=(1, 5_000_000_000_000_000_000))
        return found

    path.write_text(entry("sk-1", "one", "t") + entry("sk-2x", "two", "t"))
    os.utime(path, ns=(1, 4_000_000_000_000_000_000))
    keys._read = read_while_written  # type: ignore[method-assign]
    clock.now += CHECK_EVERY_S
    keys.refresh()
    assert keys.reloads == 0 and keys.client({"x-api-key": "sk-2x"}) is None  # not taken: it changed meanwhile
    keys._read = read  # type: ignore[method-assign]
    clock.now += CHECK_EVERY_S
    assert keys.client({"x-api-key": "sk-2"}) == Client("t", "two") and keys.reloads == 1


@pytest.mark.parametrize(
    ("tenant", "asked", "got"),
    [
        ("interactive", None, "interactive"),  # its tenant's class, without asking
        ("interactive", "system", "interactive"),  # a header never lifts it above its tenant's
        ("interactive", " BULK ", "bulk"),  # but may lower it (case and spaces aside)
        ("bulk", "interactive", "bulk"),
        (None, "system", "system"),  # without client keys, as asked
        (None, None, "default"),
    ],
)
def test_a_requests_class_is_what_it_asks_capped_by_its_tenants(
    tenant: str | None, asked: str | None, got: str
) -> None:
    client = Client("t", "k", RANK[tenant]) if tenant else None
    headers = {"x-priority": asked} if asked is not None else {}
    assert wishes(headers, client) == (RANK[got], None)
    if asked is not None:  # smg's header, the same names
        assert wishes({"x-smg-priority": asked}, client) == (RANK[got], None)


def test_a_class_or_target_that_is_no_value_is_a_400_that_says_what_is() -> None:
    refused = wishes({"x-priority": "urgent"}, None)
    assert isinstance(refused, Refused) and refused.status == 400 and "system, interactive" in refused.message
    assert wishes({"x-slo-ttft-ms": "250"}, None) == (RANK["default"], 0.25)
    for bad in ("soon", "0", "-5", "nan", "1e12"):
        refused = wishes({"x-slo-ttft-ms": bad}, None)
        assert isinstance(refused, Refused) and refused.code == "invalid_ttft_target", bad


def test_an_entry_may_name_a_client_certificate_instead_of_a_key() -> None:
    digest = hashlib.sha256(b"sk-a").hexdigest()
    text = (
        f'[[keys]]\nid = "a"\ntenant = "team-a"\nsha256 = "{digest}"\n'
        '[[keys]]\nid = "b"\ntenant = "team-b"\nsubject = "runner.team-b"\n'
    )
    clients, _ = parse(text, "f")
    assert clients["subject:runner.team-b"] == Client("team-b", "b")
    for bad, says in (
        ('[[keys]]\nid = "b"\ntenant = "t"\n', "`sha256` must be a non-empty string.*or `subject`"),
        (f'[[keys]]\nid = "b"\ntenant = "t"\nsubject = "x"\nsha256 = "{digest}"\n', "sha256.*or.*subject"),
        ('[[keys]]\nid = "b"\ntenant = "t"\nsubject = " "\n', "subject"),
    ):
        with pytest.raises(ClientKeysError, match=says):
            parse(bad, "f")
    assert subject_of({"subject": ((("countryName", "NL"),), (("commonName", "runner.team-b"),))}) == "runner.team-b"
    assert subject_of(None) is None and subject_of({}) is None
