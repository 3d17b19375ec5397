"""A fleet shared by many clients, on emulated replicas that ask for a key as vLLM's --api-key does:
client keys by tenant (read again when their file changes), the replicas' own key in place of the
client's, answers in each API's shape, and nothing but the API answering a client."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from router.config import ConfigError, load

REPLICA_KEY = "replica-secret"
ADMIN = "admin-token-0123456"
CHAT = {"model": "emulated-llm", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
MESSAGE = {"model": "emulated-llm", "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]}


def keys_file(path: Path, *keys: tuple[str, str, str]) -> str:
    text = "".join(
        f'[[keys]]\nid = "{kid}"\ntenant = "{tenant}"\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
        for key, kid, tenant in keys
    )
    path.write_text(text)
    return str(path)


async def call(
    url: str, path: str, body: Any = None, headers: dict[str, str] | None = None, method: str = "POST"
) -> tuple[int, Any, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(
            method,
            url + path,
            data=body if body is None or isinstance(body, bytes) else orjson.dumps(body),
            headers=headers,
        ) as r,
    ):
        return r.status, r.headers, await r.read()


@pytest.fixture
async def fleet(start_fleet):  # type: ignore[no-untyped-def]
    return await start_fleet(2, api_key=REPLICA_KEY)


def named(fleet: Any) -> list[str]:
    return [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]


async def test_the_emulator_asks_for_a_key_where_vllm_does(fleet) -> None:  # type: ignore[no-untyped-def]
    url = fleet.replicas[0].url
    assert (await call(url, "/v1/chat/completions", CHAT))[0] == 401
    status, _, body = await call(url, "/v1/chat/completions", CHAT, {"x-api-key": REPLICA_KEY})
    assert status == 401 and orjson.loads(body) == {"error": "Unauthorized"}  # vLLM reads no x-api-key
    assert (await call(url, "/v1/models", method="GET", headers={"Authorization": "bearer " + REPLICA_KEY}))[0] == 200
    assert (await call(url, "/metrics", method="GET"))[0] == 200 and (await call(url, "/health", method="GET"))[
        0
    ] == 200


async def test_client_keys_by_tenant_and_the_replicas_own_key(fleet, start_router, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    path = keys_file(tmp_path / "keys.toml", ("sk-team-a", "ci", "team-a"), ("sk-team-b", "notebook", "team-b"))
    router, url = await start_router(
        named(fleet),
        client_keys_file=path,
        replica_api_keys=f"*={REPLICA_KEY}",
        admin_token=ADMIN,
        log_requests="true",
        health_checks="false",
    )
    # no key, or a wrong one: a 401 in the client's own API's shape, before anything is read or sent
    status, _, body = await call(url, "/v1/chat/completions", CHAT)
    assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
    status, _, body = await call(url, "/v1/messages", MESSAGE, {"x-api-key": "sk-wrong"})
    answer = orjson.loads(body)
    assert status == 401 and answer["type"] == "error" and answer["error"]["type"] == "authentication_error"
    status, _, body = await call(url, "/v1/chat/completions", b"not json", {"Authorization": "Bearer nope"})
    assert status == 401  # not the 400 its body would get: a client without a key learns nothing
    # a valid key, as OpenAI's SDKs and Anthropic's send it: served by replicas that only take their own key
    with caplog.at_level(logging.INFO, logger="router.access"):
        status, _, body = await call(url, "/v1/chat/completions", CHAT, {"Authorization": "Bearer sk-team-a"})
        assert status == 200, body
        status, _, body = await call(url, "/v1/messages", MESSAGE, {"x-api-key": "sk-team-b"})
        assert status == 200 and orjson.loads(body)["type"] == "message"
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "router.access"]
    served = [(line["tenant"], line["key_id"]) for line in lines if line["status"] == 200]
    assert served == [("team-a", "ci"), ("team-b", "notebook")]
    assert not any("sk-team" in r.getMessage() for r in caplog.records)  # never the key itself
    # the models listing asks each replica with its key too
    status, _, body = await call(url, "/v1/models", method="GET", headers={"x-api-key": "sk-team-a"})
    assert status == 200 and [m["id"] for m in orjson.loads(body)["data"]] == ["emulated-llm"]
    assert (await call(url, "/v1/models", method="GET"))[0] == 401
    # nothing else on the API's address answers a client: /metrics asks for the admin token
    status, _, body = await call(url, "/metrics", method="GET", headers={"Authorization": "Bearer sk-team-a"})
    assert status == 401
    status, _, body = await call(url, "/metrics", method="GET", headers={"Authorization": f"Bearer {ADMIN}"})
    text = body.decode()
    assert status == 200
    assert 'router_tenant_requests_total{key_id="ci",status="200",tenant="team-a"} 1.0' in text
    assert 'router_tenant_requests_total{key_id="none",status="401",tenant="none"} 3.0' in text
    assert 'router_tenant_tokens_total{kind="completion",tenant="team-b"} 4.0' in text
    assert (await call(url, "/console/api/state", method="GET", headers={"x-api-key": "sk-team-a"}))[0] == 401
    # the file changes (a Secret's new version): a new key works and a removed one stops, without a restart
    keys_file(Path(path), ("sk-team-a2", "ci-2", "team-a"))
    async with asyncio.timeout(10):
        while (await call(url, "/v1/chat/completions", CHAT, {"Authorization": "Bearer sk-team-a2"}))[0] != 200:
            await asyncio.sleep(0.2)
    assert (await call(url, "/v1/chat/completions", CHAT, {"Authorization": "Bearer sk-team-a"}))[0] == 401
    assert router.clients is not None and router.clients.reloads == 1


async def test_the_clients_key_never_reaches_a_replica(start_router, sse_upstream, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    upstream, seen = await sse_upstream([b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', b"data: [DONE]\n\n"])
    path = keys_file(tmp_path / "keys.toml", ("sk-client", "ci", "team-a"))
    # client keys on, no replica key: the client's key is dropped, nothing put in its place
    _, url = await start_router([f"r0={upstream}"], client_keys_file=path, admin_token=ADMIN, health_checks="false")
    headers = {"Authorization": "Bearer sk-client", "x-api-key": "sk-client"}
    assert (await call(url, "/v1/chat/completions", CHAT | {"stream": True}, headers))[0] == 200
    assert not {k.lower() for k in seen[-1]} & {"authorization", "x-api-key"}
    # a replica key: it alone is sent
    _, url = await start_router(
        [f"r0={upstream}"], client_keys_file=path, admin_token=ADMIN, replica_api_keys="r0=k-r0", health_checks="false"
    )
    assert (await call(url, "/v1/chat/completions", CHAT | {"stream": True}, headers))[0] == 200
    sent = {k.lower(): v for k, v in seen[-1].items()}
    assert sent["authorization"] == "Bearer k-r0" and "x-api-key" not in sent
    # client keys off and no replica key: the client's own Authorization goes through, as before
    _, url = await start_router([f"r0={upstream}"], health_checks="false")
    assert (await call(url, "/v1/chat/completions", CHAT | {"stream": True}, {"Authorization": "Bearer e2e"}))[0] == 200
    assert {k.lower(): v for k, v in seen[-1].items()}["authorization"] == "Bearer e2e"


def test_client_keys_need_the_console_and_metrics_kept_from_clients(tmp_path: Path) -> None:
    path = keys_file(tmp_path / "keys.toml", ("sk", "ci", "t"))
    with pytest.raises(ConfigError, match=r"client_keys_file.*admin_token.*admin_port"):
        load(None, {}, {"replicas": ["r0=http://127.0.0.1:9"], "client_keys_file": path})
    assert load(None, {}, {"replicas": ["r0=http://127.0.0.1:9"], "client_keys_file": path, "admin_port": "9100"})
    with pytest.raises(ConfigError, match="REPLICA_ID=KEY") as caught:
        load(None, {}, {"replicas": ["r0=http://127.0.0.1:9"], "replica_api_keys": "sk-oops"})
    assert "sk-oops" not in str(caught.value)  # an entry that may be a key is never echoed


@pytest.mark.parametrize("front", ["true", "false"])
async def test_a_request_without_a_key_is_refused_before_its_body_is_parsed(  # type: ignore[no-untyped-def]
    fleet, start_router, tmp_path: Path, caplog, front: str
) -> None:
    path = keys_file(tmp_path / "keys.toml", ("sk-team-a", "ci", "team-a"))
    router, url = await start_router(
        named(fleet), client_keys_file=path, replica_api_keys=f"*={REPLICA_KEY}", admin_token=ADMIN, front=front
    )
    with caplog.at_level(logging.WARNING):
        async with aiohttp.ClientSession() as s:  # one keep-alive connection: a refusal must leave it usable
            for headers, status in (({}, 401), ({"Authorization": "Bearer sk-team-a"}, 200), ({}, 401)):
                async with s.post(url + "/v1/chat/completions", data=orjson.dumps(CHAT), headers=headers) as r:
                    assert r.status == status
                    await r.read()
            big = b'{"model": "emulated-llm", "messages": [' + b" " * 500_000 + b"]}"
            async with s.post(url + "/v1/chat/completions", data=big, headers={"Expect": "100-continue"}) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert router.metrics.tenant_requests.labels("none", "none", "401")._value.get() == 3
