"""A stream a replica breaks mid-way is continued on another replica inside the same client stream."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 20}


def named(replicas: Any) -> list[str]:
    return [f"{r.options.replica_id}={r.url}" for r in replicas]


async def stream(url: str, path: str, body: dict[str, Any], key: str) -> tuple[int, list[Any], bytes]:
    """The stream's events, parsed ([DONE] as the string "[DONE]"), and the raw body."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + path, data=orjson.dumps(body), headers={"X-Session-ID": key}) as r,
    ):
        raw = await r.read()
    events: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return r.status, events, raw


def text_of(events: list[Any]) -> tuple[str, int]:
    """The streamed text and the number of chunks that carried any."""
    parts = []
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices") or ():
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if piece:
                    parts.append(piece)
    return "".join(parts), len(parts)


async def prompt_tokens(replica_url: str, body: dict[str, Any], path: str) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.post(replica_url + path, json={**body, "stream": False, "stream_options": None, "max_tokens": 1}) as r,
    ):
        return int((await r.json())["usage"]["prompt_tokens"])


async def test_a_chat_stream_cut_mid_way_is_resumed_on_another_replica(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    router, url = await start_router(named(fleet.replicas))
    home = router.fleet.ring.lookup(b"resume-1")
    other = 1 - home
    fleet.replicas[home].set_faults({"drop_after": 6})  # the role chunk and five tokens, then the cut
    body = {
        "model": "emulated-llm",
        "messages": [SYSTEM, {"role": "user", "content": "tell me a story " * 10}],
        "max_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, events, raw = await stream(url, "/v1/chat/completions", body, "resume-1")
    assert status == 200 and events[-1] == "[DONE]" and b'"error"' not in raw
    chunks = [e for e in events if isinstance(e, dict)]
    assert len({e["id"] for e in chunks}) == 1 and len({e["created"] for e in chunks}) == 1  # one response
    roles = [e for e in chunks if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert len(roles) == 1  # the continuation's own opening chunk was dropped
    text, pieces = text_of(events)
    assert pieces == 24 and len(text) == 24 * 4  # every token asked for, none twice
    assert [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]] == ["length"]
    usage = chunks[-1]["usage"]
    expected_prompt = await prompt_tokens(fleet.replicas[other].url, body, "/v1/chat/completions")
    assert usage["prompt_tokens"] == expected_prompt and usage["completion_tokens"] == 24
    assert usage["total_tokens"] == expected_prompt + 24
    m = router.metrics
    assert m.stream_resumes.labels("resumed")._value.get() == 1
    assert m.stream_errors.labels(fleet.replicas[home].options.replica_id)._value.get() == 1
    # the continuation was asked of the other replica with the text so far as an open assistant message
    state = fleet.replicas[other].state()["engine"]
    assert state["finished_total"] >= 2 and state["prompt_tokens_total"] >= expected_prompt + 5
    # the session now lives where its whole conversation is cached
    assert router.sessions.get(b"resume-1") == fleet.replicas[other].options.replica_id


async def test_a_stalled_completion_is_resumed_and_the_official_client_sees_one_stream(  # type: ignore[no-untyped-def]
    start_fleet, start_router
) -> None:
    fleet = await start_fleet(2)
    router, url = await start_router(named(fleet.replicas), idle_timeout_s=0.3)
    home = router.fleet.ring.lookup(b"resume-2")
    fleet.replicas[home].set_faults({"stall_after": 4})
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    pieces: list[str] = []
    finish = []
    result = await asyncio.wait_for(
        client.completions.create(
            model="emulated-llm",
            prompt="once upon a time " * 20,
            max_tokens=16,
            stream=True,
            extra_headers={"X-Session-ID": "resume-2"},
        ),
        10,
    )
    async for chunk in result:
        for c in chunk.choices:
            pieces.append(c.text)
            if c.finish_reason:
                finish.append(c.finish_reason)
    await client.close()
    assert len([p for p in pieces if p]) == 16 and finish == ["length"]
    assert router.metrics.stream_resumes.labels("resumed")._value.get() == 1


async def test_streams_that_cannot_be_resumed_end_with_an_error_event(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    for r in fleet.replicas:
        r.set_faults({"drop_after": 3})
    router, url = await start_router(named(fleet.replicas))
    m = router.metrics
    body = {"model": "emulated-llm", "prompt": "abcd" * 50, "max_tokens": 20, "stream": True}
    # every replica breaks it: its continuation breaks too, and it is not resumed a second time
    status, events, _ = await stream(url, "/v1/completions", body, "resume-3")
    assert status == 200 and events[-1] == "[DONE]" and "error" in events[-2]
    assert m.stream_resumes.labels("resumed")._value.get() == 0
    assert m.stream_resumes.labels("failed")._value.get() == 1
    assert (
        sum(r.state()["engine"]["finished_total"] + r.state()["engine"]["aborted_total"] for r in fleet.replicas) == 2
    )
    # and with resuming off, the first break ends the stream
    router2, url2 = await start_router(named(fleet.replicas), resume_streams=False)
    status, events, _ = await stream(url2, "/v1/completions", body, "resume-5")
    assert "error" in events[-2] and "mid-stream" in events[-2]["error"]["message"]
    assert router2.metrics.stream_resumes.labels("resumed")._value.get() == 0


async def test_a_stream_past_the_resume_buffer_is_not_resumed(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    for r in fleet.replicas:
        r.set_faults({"drop_after": 10})
    router, url = await start_router(named(fleet.replicas), resume_buffer_bytes=300)
    body = {"model": "emulated-llm", "prompt": "abcd" * 50, "max_tokens": 20, "stream": True}
    _, events, _ = await stream(url, "/v1/completions", body, "resume-6")
    assert "error" in events[-2]
    assert router.metrics.stream_resumes.labels("impossible")._value.get() == 1


async def test_a_stream_cut_after_its_last_token_is_closed_without_an_error(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    for r in fleet.replicas:
        r.set_faults({"drop_after": 4})  # role, three tokens (the last with its finish_reason), then the cut
    router, url = await start_router(named(fleet.replicas))
    body = {"model": "emulated-llm", "messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 3}
    _, events, raw = await stream(url, "/v1/chat/completions", {**body, "stream": True}, "resume-7")
    assert events[-1] == "[DONE]" and b"error" not in raw
    assert text_of(events)[1] == 3
    assert router.metrics.stream_resumes.labels("finished")._value.get() == 1
    assert sum(r.state()["engine"]["finished_total"] for r in fleet.replicas) == 1  # nothing was sent again
