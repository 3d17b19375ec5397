"""Fuzzed HTTP on raw sockets against a real router-serve (client keys on, one emulated replica), on
both of its HTTP paths (the front, and aiohttp's with --no-front): generated request lines
(methods, targets of every form, versions), headers (the ones the router reads, repeated, with any
bytes) and bodies, to the proxied endpoints of every API and to the rest. Every answer is a 4xx in
JSON (aiohttp's own parser may answer a plain-text 400), a success, or the connection closed;
never a 5xx, a hang or a traceback on the router's log; and a well-formed request is served
meanwhile. The number of inputs tried is printed (`pytest -s`) and written in docs/router.md."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from demo import running_demo
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

KEY = "sk-fuzz-0123456789"
ADMIN = "fuzz-admin-token-0123456789"
PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/responses/resp_x",
    "/v1/models",
    "/health",
    "/metrics",
    "/admin/replicas",
    "/console",
    "/nowhere",
)
ODD_TARGETS = (
    "*",
    "http://router.test/v1/chat/completions",
    "https://[::1/v1/messages",
    "http://:99999/",
    "//v1/chat/completions",
    "/v1/chat/completions?x=%ZZ&y",
    "/v1/chat/completions/../../admin/replicas",
    "/%2e%2e/admin/replicas",
    "/v1/chat/completions#frag",
    "example.com:443",
)
# weighted to requests the router reads past its parser (POST to an API, HTTP/1.x), and the rest
METHODS = ("POST",) * 12 + ("GET", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "CONNECT", "TRACE", "BREW", "post")
VERSIONS = ("HTTP/1.1",) * 8 + ("HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.12", "")
API_PATHS = PATHS[:5]
NAMES = (
    "Content-Length",
    "Transfer-Encoding",
    "Authorization",
    "x-api-key",
    "Expect",
    "Connection",
    "Content-Type",
    "X-Priority",
    "x-slo-ttft-ms",
    "X-Session-ID",
    "Upgrade",
    "Host",
)
VALUES = (
    f"Bearer {KEY}",
    KEY,
    "Bearer sk-wrong",
    "chunked",
    "gzip, chunked",
    "0",
    "5",
    "-1",
    "99999999999999999999",
    "100-continue",
    "close",
    "keep-alive, Upgrade",
    "application/json",
    "system",
    "nan",
    "websocket",
)
TRIED: dict[str, int] = {"front": 0, "aiohttp": 0}
SEEN: dict[str, dict[int, int]] = {"front": {}, "aiohttp": {}}  # answers by status

header_value = st.sampled_from(VALUES) | st.binary(max_size=60).filter(
    lambda b: not (set(b) & {0, 10, 13})  # (a line break would make it another header: tried below)
).map(lambda b: b.decode("latin-1"))
json_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["emulated-llm", "", "x" * 300]), "max_tokens": st.sampled_from([1, 2, 0, -1])},
    optional={
        "messages": st.sampled_from([[{"role": "user", "content": "hi"}], [], "x", [{"role": 3}]]),
        "prompt": st.sampled_from(["hi", 5, None]),
        "input": st.sampled_from(["hi", [], {"a": 1}]),
        "stream": st.sampled_from([True, False, "yes"]),
        "previous_response_id": st.sampled_from(["resp_x", 7]),
    },
).map(lambda d: json.dumps(d).encode())
body = json_body | st.binary(max_size=600)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from(METHODS) | st.text("ABCXYZ-_!", min_size=1, max_size=8))
    target = draw(
        st.sampled_from(API_PATHS)
        | st.sampled_from(API_PATHS)
        | st.sampled_from(PATHS)
        | st.sampled_from(ODD_TARGETS)
        | st.binary(max_size=40).filter(lambda b: not (set(b) & {0, 10, 13, 32})).map(lambda b: b.decode("latin-1"))
    )
    version = draw(st.sampled_from(VERSIONS))
    payload = draw(body)
    headers = [("Host", "router.test")] if draw(st.integers(0, 4)) else []
    if draw(st.integers(0, 3)):
        headers.append(("Authorization", f"Bearer {KEY}"))
    headers += draw(st.lists(st.tuples(st.sampled_from(NAMES), header_value), max_size=6))
    framing = draw(st.sampled_from(["length"] * 4 + ["none", "chunked", "wrong-length", "raw"]))
    if framing == "length":
        headers.append(("Content-Length", str(len(payload))))
    elif framing == "chunked":
        headers.append(("Transfer-Encoding", "chunked"))
        payload = b"%x\r\n%b\r\n0\r\n\r\n" % (len(payload), payload) if payload else b"0\r\n\r\n"
    elif framing == "wrong-length":
        headers.append(("Content-Length", str(max(0, len(payload) - draw(st.integers(-5, 5))))))
    line = f"{method} {target} {version}".rstrip().encode("latin-1")
    head = b"\r\n".join([line, *(f"{n}: {v}".encode("latin-1") for n, v in headers)])
    if draw(st.integers(0, 19)) == 0:  # a bare line feed, a header without a colon, a folded line
        head += draw(st.sampled_from([b"\nX-Bare: 1", b"\r\nNo colon here", b"\r\n folded"]))
    return head + b"\r\n\r\n" + payload


def exchange(port: int, data: bytes, timeout: float = 8.0) -> bytes:
    """Send `data`; read one whole answer (by its length, its chunks, or the connection's end)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(OSError):  # refused and closed while it was still sending: read what came
            s.sendall(data)
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionError):
                break
            if not chunk:
                break
            out += chunk
            if whole(out):
                break
        else:
            pytest.fail(f"no whole answer within {timeout} s: {data[:200]!r} -> {out[:200]!r}")
        return out


def whole(answer: bytes) -> bool:
    head, sep, rest = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    lines = head.split(b"\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(b":") for x in lines[1:])}
    status = int(lines[0].split()[1]) if len(lines[0].split()) > 1 else 0
    if status in (100, 101):
        return whole(rest) if rest else False
    if b"content-length" in fields:
        return len(rest) >= int(fields[b"content-length"])
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        return rest.endswith(b"0\r\n\r\n")
    return False  # to the connection's end


def check(path: str, data: bytes, answer: bytes) -> None:
    if not answer:
        return  # closed without an answer: allowed
    # (aiohttp answers in the version the request line claimed, HTTP/2.0 included)
    assert re.match(rb"HTTP/\d\.\d \d{3} ", answer), (data[:200], answer[:200])
    head, _, rest = answer.partition(b"\r\n\r\n")
    if head.startswith(b"HTTP/1.1 100 "):
        head, _, rest = rest.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    SEEN[path][status] = SEEN[path].get(status, 0) + 1
    assert status < 500, (data[:300], answer[:300])
    if status < 400 or data.startswith(b"HEAD ") or not rest:
        return
    fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(b":") for x in head.split(b"\r\n")[1:])}
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        return  # (an error streamed as the replica's own answer: not the router's shape to keep)
    if b"text/plain" in fields.get(b"content-type", b"") and status == 400:
        return  # aiohttp's own parser's refusal (the front hands it what is not a proxied request)
    if b"content-length" in fields:
        # only the first answer's body: bytes after a body-less request's head are the next
        # request, and its own answer may arrive in the same read
        rest = rest[: int(fields[b"content-length"])]
    error = json.loads(rest)
    assert isinstance(error, dict) and "error" in error, (data[:300], answer[:300])


def served(port: int) -> bool:
    body = b'{"model": "emulated-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return exchange(port, head + body).startswith(b"HTTP/1.1 200 ")


@pytest.fixture(scope="module", params=["front", "aiohttp"])
def router(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    folder = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    keys = folder / "keys.toml"
    keys.write_text(f'[[keys]]\nid = "fuzz"\ntenant = "t"\nsha256 = "{hashlib.sha256(KEY.encode()).hexdigest()}"\n')
    log = folder / "router.log"
    flags = ["--client-keys-file", str(keys), "--admin-token", ADMIN, "--max-body-bytes", "4096"]
    flags += ["--client-timeout-s", "2", "--log-requests"]
    if request.param == "aiohttp":
        flags.append("--no-front")
    with running_demo(1, *flags, log=log) as (port, _pid):
        yield request.param, port, log


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=requests())
# no Content-Length: an empty body, and what follows is a second (malformed) request on the connection
@example(data=b"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer %s\r\n\r\n\x0b5\xcf\x17N" % KEY.encode())
# a CONNECT's target matches no route: aiohttp's own Expect handler echoed the byte into its text (a 500)
@example(data=b"CONNECT /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: \x80\r\nContent-Length: 2\r\n\r\n{}")
def test_any_request_gets_a_shaped_4xx_an_answer_or_a_close(router: tuple[str, int, Path], data: bytes) -> None:
    path, port, _ = router
    check(path, data, exchange(port, data))
    TRIED[path] += 1
    if TRIED[path] % 50 == 0:
        assert served(port), "a well-formed request was not served during the fuzzing"


def test_after_the_fuzzing_it_serves_and_logged_no_traceback(router: tuple[str, int, Path]) -> None:
    path, port, log = router
    assert served(port)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
    print(f"fuzzed HTTP ({path}): {TRIED[path]} requests, answers by status {dict(sorted(SEEN[path].items()))}")
    assert TRIED[path] >= 300
