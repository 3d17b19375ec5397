"""The Responses API's parts in the router: its keys, its stream's framer, its usage, its pin."""

from __future__ import annotations

import orjson
import pytest

from router.config import ReplicaSpec, RouterConfig
from router.fleet import Fleet
from router.keys import response_key, stored_key
from router.metrics import RouterMetrics
from router.policy import make_policy
from router.proxy.framer import ResponsesFramer
from router.proxy.intake import Intake, take_in_body
from router.proxy.sse import usage_of
from router.routing import Routing, SessionDirectory
from router.routing.request import Keys
from router.sessions import SessionTable


def events(response_id: str = "resp_1", crlf: bool = False) -> bytes:
    def one(kind: str, **fields: object) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    done = {
        "id": response_id,
        "usage": {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 5},
    }
    raw = (
        one("response.created", response={"id": response_id, "status": "in_progress"})
        + one("response.output_text.delta", delta='say "response.completed" here')
        + one("response.output_text.delta", delta="more")
        + one("response.completed", response=done)
    )
    return raw.replace(b"\n", b"\r\n") if crlf else raw


@pytest.mark.parametrize("crlf", [False, True])
@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
def test_the_framer_passes_a_stream_unchanged_and_reads_its_id_usage_and_end(size: int, crlf: bool) -> None:
    raw = events(crlf=crlf)
    framer = ResponsesFramer()
    out = b""
    for i in range(0, len(raw), size):
        assert not framer.done or i + size >= len(raw)
        out += framer.feed(raw[i : i + size])
    out += framer.pending()
    assert out == raw
    assert framer.response_id == "resp_1" and framer.usage == (40, 32, 5) and framer.done


def test_a_stream_cut_short_is_not_done_and_a_last_event_without_its_blank_line_counts() -> None:
    raw = events()
    cut = ResponsesFramer()
    cut.feed(raw[: raw.index(b"event: response.completed")])
    assert cut.response_id == "resp_1" and not cut.done and cut.usage is None
    whole = ResponsesFramer()
    whole.feed(raw[:-2])  # the final event's blank line never came
    assert not whole.done
    assert whole.pending().startswith(b"event: response.completed") and whole.done


def test_usage_in_both_apis_names() -> None:
    chat = {"usage": {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}}
    responses = {"usage": {"input_tokens": 10, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 4}}}
    assert usage_of(chat) == usage_of(responses) == (10, 4, 3)


def test_a_follow_up_is_keyed_by_what_it_continues_before_any_session_header() -> None:
    cfg = RouterConfig()
    body = {"model": "m", "input": "hi", "previous_response_id": "resp_9", "conversation": "conv_1"}
    admitted = take_in_body("/v1/responses", {"x-session-id": "s"}, orjson.dumps(body), cfg.proxying, Keys.of(cfg))
    assert isinstance(admitted, Intake)
    assert (admitted.key.key, admitted.key.kind, admitted.key.model) == (stored_key("resp_9", 256), "response", "m")
    assert admitted.keep == 0 and not admitted.strip_usage  # not resumed, usage never injected
    key = response_key({"conversation": {"id": "conv_1"}}, 256)
    assert key is not None and key.source == "conversation" and key.kind == "response"
    assert response_key({"input": "hi"}, 256) is None
    plain = take_in_body(
        "/v1/responses", {"x-session-id": "s"}, orjson.dumps({"input": "hi"}), cfg.proxying, Keys.of(cfg)
    )
    assert isinstance(plain, Intake) and plain.key.kind == "header"  # a first turn: as any request
    chat = take_in_body(
        "/v1/chat/completions", {}, orjson.dumps({"previous_response_id": "resp_9"}), cfg.proxying, Keys.of(cfg)
    )
    assert isinstance(chat, Intake) and chat.key.kind != "response"  # only the Responses API continues by id


def routing(policy: str = "affinity") -> Routing:
    fleet = Fleet([ReplicaSpec(f"r{i}", f"http://10.0.0.{i}:1") for i in range(3)])
    cfg = RouterConfig(policy=policy, bounded_load_floor=1, bounded_load_c=1.0)
    directory = SessionDirectory(SessionTable(1000, 600), 600)
    return Routing(fleet, make_policy(policy, fleet, cfg), directory, RouterMetrics(), 3)


async def test_a_stored_response_pins_its_follow_up_to_its_replica_whatever_its_load() -> None:
    r = routing()
    key = response_key({"previous_response_id": "resp_1"}, 256)
    assert key is not None
    r.directory.table.put(key.key, "r1")
    r.fleet.loads[1] = 50  # a session there would spill
    route = await r.route(key, 0.0, 1e9)
    first = route.next(0.0)
    assert first is not None and first.id == "r1" and route.decision is not None and route.decision.reason == "sticky"
    route.release(first)
    assert route.next(0.0) is None  # no other replica holds it: no retry
    r.fleet.drain("r1")
    route = await r.route(key, 0.0, 1e9)
    again = route.next(0.0)
    assert again is not None and again.id == "r1"  # a draining replica still answers what it stored
    r.fleet.remove("r1")
    route = await r.route(key, 0.0, 1e9)
    elsewhere = route.next(0.0)
    assert elsewhere is not None and elsewhere.id != "r1"  # gone: placed as any key (the replica there says)
