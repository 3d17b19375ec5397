"""Coding agents' own session headers through router-serve, on emulated replicas: Claude Code's
turns (Anthropic's Messages API) stay on one replica, and a sub-agent starts on its parent's."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

SYSTEM = "You are a coding agent. Read the repository, then answer. " * 12


def named(replicas: Any) -> list[str]:
    return [f"{r.options.replica_id}={r.url}" for r in replicas]


async def message(url: str, texts: list[str], headers: dict[str, str]) -> str:
    """One Messages API turn of a conversation whose user turns are `texts`; the replica that served it."""
    messages: list[dict[str, str]] = []
    for i, text in enumerate(texts):
        if i:
            messages.append({"role": "assistant", "content": f"noted {i}"})
        messages.append({"role": "user", "content": text})
    body = {"model": "emulated-llm", "max_tokens": 4, "system": SYSTEM, "messages": messages}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url + "/v1/messages", data=orjson.dumps(body), headers={"Content-Type": "application/json"} | headers
        ) as r,
    ):
        assert r.status == 200, await r.text()
        assert (await r.json())["type"] == "message"
        return r.headers["X-Router-Replica"]


async def test_claude_codes_session_stays_on_one_replica(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4)
    router, url = await start_router(named(fleet.replicas))  # the default policy
    for session in ("cc-a", "cc-b", "cc-c"):
        headers = {"x-claude-code-session-id": session}
        texts = [f"{session}: fix the failing test in module {n}" for n in range(4)]
        served = {await message(url, texts[: n + 1], headers) for n in range(4)}
        assert len(served) == 1, session  # every turn where its conversation is cached
        assert router.directory.table.get(session.encode()) == served.pop()  # keyed by the agent's header


async def test_a_sub_agent_starts_on_its_parents_replica(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4)
    router, url = await start_router(named(fleet.replicas), policy="affinity")
    ring, replicas = router.fleet.ring, router.fleet.replicas
    root = {"x-claude-code-session-id": "cc-root"}
    parent = await message(url, ["plan the refactor"], root)
    # sub-agents whose own ids the ring would place on other replicas
    agents = [
        a for a in (f"agent-{n}" for n in range(100)) if replicas[ring.lookup(f"cc-root/{a}".encode())].id != parent
    ][:3]
    for agent in agents:
        headers = root | {"x-claude-code-agent-id": agent}
        assert await message(url, [f"{agent}: search the code"], headers) == parent  # starts beside its parent
        assert await message(url, [f"{agent}: search the code", "go on"], headers) == parent  # ... and stays
    # a nested sub-agent names its parent agent, which it joins
    nested = root | {"x-claude-code-agent-id": "agent-nested", "x-claude-code-parent-agent-id": agents[0]}
    assert await message(url, ["look deeper"], nested) == parent
    # with the agents' headers off, the same sub-agent is only a session header away from anywhere
    _, plain = await start_router(named(fleet.replicas), policy="affinity", agent_session_headers="false")
    headers = {"x-session-id": agents[1]}
    assert (
        await message(plain, [f"{agents[1]}: search the code"], headers) == replicas[ring.lookup(agents[1].encode())].id
    )
