"""Fuzzed requests against a real router-serve (with one emulated replica): whatever arrives, the
answer is a success or an OpenAI-shaped 4xx, never a 5xx of the router's own, and it stays up."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from demo import running_demo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[int, int]]:
    with running_demo(1, "--max-body-bytes", "65536") as running:
        yield running


def post(port: int, method: str, path: str, body: bytes, headers: dict[str, Any] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.putrequest(method, path)
        for name, value in (headers or {"Content-Type": "application/json"}).items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def check(status: int, body: bytes) -> None:
    assert status != 0, "no answer: the router closed the connection"
    assert status < 500, (status, body[:300])
    if status >= 400:
        error = json.loads(body)["error"]  # OpenAI-shaped
        assert isinstance(error["message"], str) and error["message"]


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=JSON)
def test_any_json_body(router: tuple[int, int], body: Any) -> None:
    check(*post(router[0], "POST", "/v1/chat/completions", json.dumps(body).encode()))


@FUZZ
@given(raw=st.binary(max_size=3000))
def test_any_bytes_as_a_body(router: tuple[int, int], raw: bytes) -> None:
    check(*post(router[0], "POST", "/v1/completions", raw))


@FUZZ
@given(
    # any bytes HTTP allows in a header value (visible ASCII, space, tab, and 0x80-0xFF: invalid UTF-8 too)
    key=st.binary(min_size=1, max_size=400)
    .map(bytes.strip)
    .filter(lambda b: bool(b) and all((c >= 0x20 and c != 0x7F) or c == 9 for c in b)),
    fields=st.dictionaries(st.sampled_from(["user", "session_id", "metadata", "stream", "max_tokens"]), JSON).filter(
        # a long reply is a valid answer that outlasts the client's time-out (the demo decodes in real
        # time, 10 ms a token): a length the replica takes is kept short, one it refuses may be any
        lambda f: not (type(f.get("max_tokens")) is int and 256 < f["max_tokens"] < 1 << 20)
    ),
)
def test_keys_of_any_bytes_and_fields_of_any_type(router: tuple[int, int], key: bytes, fields: dict[str, Any]) -> None:
    body = {"model": "emulated-llm", "messages": MESSAGES, "max_tokens": 2, **fields}
    status, answer = post(
        router[0],
        "POST",
        "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-Session-ID": key},
    )
    check(status, answer)


def test_it_is_still_up_and_small_after_the_fuzzing(router: tuple[int, int]) -> None:
    port, pid = router
    status, body = post(port, "POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES}).encode())
    assert status == 200 and json.loads(body)["choices"]
    with open(f"/proc/{pid}/status") as status_file:
        rss_kib = next(int(line.split()[1]) for line in status_file if line.startswith("VmRSS:"))
    assert rss_kib < 400 * 1024  # the router and its demo replica, after hundreds of odd requests
    for method, path in (("PUT", "/v1/chat/completions"), ("GET", "/nowhere"), ("DELETE", "/admin/replicas")):
        status, body = post(port, method, path, b"")
        assert 400 <= status < 500 and json.loads(body)["error"]["message"], (method, path, status, body[:200])
