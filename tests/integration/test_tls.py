"""HTTPS as router-serve serves it (router.tls), with certificates made here (trustme): the OpenAI
SDK over TLS, a certificate read again when its files change, client certificates required
(mTLS), and HTTPS to a replica that asks the router for its own certificate."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import trustme
from aiohttp import web

CHAT = {"model": "emulated-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def write(cert: trustme.LeafCert, folder: Path, name: str) -> tuple[str, str]:
    """The certificate chain and its key as PEM files."""
    chain, key = folder / f"{name}.pem", folder / f"{name}.key"
    cert.private_key_pem.write_to_path(str(key))
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return str(chain), str(key)


def ask(
    url: str, ca: trustme.CA, client_cert: trustme.LeafCert | None = None, stream: bool = False, key: str = "none"
) -> str:
    """One chat turn through the OpenAI SDK over HTTPS, trusting `ca` alone (and presenting `client_cert`)."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if client_cert is not None:
        client_cert.configure_cert(context)
    with openai.DefaultHttpxClient(verify=context, timeout=20) as http:  # (the SDK's own HTTP client)
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, http_client=http, max_retries=0)
        if stream:
            parts = client.chat.completions.create(**CHAT, stream=True)
            return "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        answer = client.chat.completions.create(**CHAT)
        return answer.choices[0].message.content or ""


async def test_https_with_the_openai_sdk_and_a_certificate_read_again_when_it_changes(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any], tmp_path: Path
) -> None:
    ca = trustme.CA()
    cert, key = write(ca.issue_cert("127.0.0.1", "localhost"), tmp_path, "server")
    fleet = await start_fleet(1)
    node, url = await start_router([r.url for r in fleet.replicas], tls_cert_file=cert, tls_key_file=key)
    assert url.startswith("https://")
    assert await asyncio.to_thread(ask, url, ca) and await asyncio.to_thread(ask, url, ca, None, True)
    with pytest.raises(aiohttp.ClientError):  # plain HTTP on the HTTPS port gets nothing it can read
        async with aiohttp.ClientSession() as http, http.get(url.replace("https", "http") + "/health") as r:
            await r.read()
    # a renewed certificate, from another CA: read again from the same files, new connections get it
    renewed = trustme.CA()
    write(renewed.issue_cert("127.0.0.1"), tmp_path, "server")
    assert node.tls.check() and node.tls.reloads == 1
    assert await asyncio.to_thread(ask, url, renewed)
    with pytest.raises(openai.APIConnectionError):
        await asyncio.to_thread(ask, url, ca)  # the old CA no longer vouches for it
    # a change that does not load (a key that is not this certificate's) keeps the one in force
    Path(key).write_bytes(trustme.CA().issue_cert("127.0.0.1").private_key_pem.bytes())
    assert not node.tls.check() and node.tls.rejected == 1
    assert await asyncio.to_thread(ask, url, renewed)


async def test_client_certificates_are_required_with_a_client_ca_and_name_a_tenant(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any], tmp_path: Path
) -> None:
    ca, clients_ca = trustme.CA(), trustme.CA()
    cert, key = write(ca.issue_cert("127.0.0.1"), tmp_path, "server")
    clients_ca.cert_pem.write_to_path(str(tmp_path / "clients-ca.pem"))
    keys = tmp_path / "keys.toml"  # a key for team-a, a certificate's subject for team-b
    digest = hashlib.sha256(b"sk-team-a-0123456789").hexdigest()
    keys.write_text(
        f'[[keys]]\nid = "ci"\ntenant = "team-a"\nsha256 = "{digest}"\n'
        '[[keys]]\nid = "batch"\ntenant = "team-b"\nsubject = "batch-runner.team-b"\n'
    )
    fleet = await start_fleet(1)
    node, url = await start_router(
        [r.url for r in fleet.replicas],
        tls_cert_file=cert,
        tls_key_file=key,
        tls_client_ca_file=str(tmp_path / "clients-ca.pem"),
        client_keys_file=str(keys),
        admin_token="tls-test-admin-token",
    )
    batch = clients_ca.issue_cert("batch-runner.team-b", common_name="batch-runner.team-b")
    assert await asyncio.to_thread(ask, url, ca, batch)  # its certificate says whose it is (the SDK's key is none's)
    assert node.metrics.tenant_requests.labels("team-b", "batch", "200")._value.get() == 1
    stranger = clients_ca.issue_cert("someone.else", common_name="someone.else")
    with pytest.raises(openai.AuthenticationError):
        await asyncio.to_thread(ask, url, ca, stranger)  # a good certificate, but nobody's: 401
    assert await asyncio.to_thread(ask, url, ca, stranger, key="sk-team-a-0123456789")  # ... with a key: the key's
    with pytest.raises(openai.BadRequestError):  # a key and a certificate naming two clients: never guessed
        await asyncio.to_thread(ask, url, ca, batch, key="sk-team-a-0123456789")
    with pytest.raises(openai.APIConnectionError):
        await asyncio.to_thread(ask, url, ca)  # no certificate: no handshake
    with pytest.raises(openai.APIConnectionError):
        await asyncio.to_thread(ask, url, ca, trustme.CA().issue_cert("stranger@elsewhere"))  # another CA's


@pytest.fixture
async def https_replica(tmp_path: Path) -> AsyncIterator[tuple[str, trustme.CA, trustme.CA]]:
    """A replica stand-in over HTTPS that asks for a client certificate: (its URL, its CA, the CA
    whose client certificates it accepts)."""
    ca, clients_ca = trustme.CA(), trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    clients_ca.configure_trust(context)
    context.verify_mode = ssl.CERT_REQUIRED

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        usage = {"prompt_tokens": 1, "completion_tokens": 2}
        body = {"choices": [{"message": {"content": "over tls"}}], "usage": usage}
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"https://127.0.0.1:{port}", ca, clients_ca
    await runner.cleanup()


async def test_https_to_a_replica_that_asks_for_the_routers_certificate(
    https_replica: tuple[str, trustme.CA, trustme.CA], start_router: Callable[..., Any], tmp_path: Path
) -> None:
    url, ca, clients_ca = https_replica
    ca.cert_pem.write_to_path(str(tmp_path / "replica-ca.pem"))
    cert, key = write(clients_ca.issue_cert("router@fleet.test"), tmp_path, "router-client")
    tls = {"replica_ca_file": str(tmp_path / "replica-ca.pem"), "health_checks": False}
    _, router = await start_router([url], **tls, replica_cert_file=cert, replica_key_file=key)
    async with aiohttp.ClientSession() as http, http.post(router + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "over tls"
    # without its certificate the replica refuses the handshake: the router says so, it does not hang
    _, bare = await start_router([url], **tls, max_attempts=1)
    async with aiohttp.ClientSession() as http, http.post(bare + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 502, await r.text()
