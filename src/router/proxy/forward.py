"""One upstream attempt: send the request to a replica and stream its answer to the client.

The client's response is not started until the replica's first body bytes arrive, so anything
that goes wrong before then (refused connection, reset, 5xx, time-out) is reported as a
`Retry` and the caller tries the next replica. One failure is not the replica's: a pooled
keep-alive connection it had already closed (llama-server closes one after every streamed
response although it answers `Keep-Alive`; uvicorn closes idle ones after 5 s), found out when the
request cannot be written or the connection ends before any answer. That request is sent once
more, at once, on a new connection to the same replica (`Upstream`): no failover, no error charged,
no session jump. Once bytes have gone out, a broken upstream is
left open for the caller to resume on another replica (`resume`, see resume.py) or ends the
client's stream with an SSE error event and `[DONE]`, never a silent cut.

Streams pass through byte for byte, framed only at event boundaries (`\\n\\n`, router.proxy.framer)
so the router can read the usage event; when the router asked upstream for usage on the client's
behalf, that one event is dropped. The Responses API's and Anthropic's Messages streams have
framers of their own (router.proxy.framer). Non-streamed bodies pass through unchanged.

It is past 450 lines as one room: an attempt's send, its relay to the client and a broken stream's
resume share what the stream has sent and what can be resumed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import orjson
from multidict import CIMultiDictProxy

from router.apis import CHAT
from router.engines.upstream import ConnectError, Response, Upstream
from router.errors import in_shape, messages_error_event, responses_error_event, sse_error_event, wrapped
from router.proxy.exchange import Exchange
from router.proxy.framer import MessagesFramer, ResponsesFramer, SseFramer
from router.proxy.intake import Intake
from router.proxy.resume import StreamRecord, streamed_text
from router.proxy.sse import StreamFramer, calls_tools, usage_of
from router.routing import Served
from router.tenancy.clients import KEY_HEADERS
from router.web import JSON

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Proxy-Connection",  # the non-standard one some clients still send
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
RESPONSE_DROP = HOP_BY_HOP | {"content-length", "date", "server"}
FINAL_WRITE_GRACE_S = 1.0
TAIL_WAIT_S = 1.0  # how long a connection waits for its answer's HTTP end after the stream's own (`[DONE]`)


@dataclass
class Retry:
    """This attempt failed before any byte reached the client; another replica may serve it."""

    cause: str  # connect | timeout | http_5xx | reset
    status: int = 502
    body: bytes = b""
    content_type: str = "application/json"


@dataclass(frozen=True, slots=True)
class Split:
    """A request prefilled on one replica and decoded on another (router.proxy.disagg): where it
    was prefilled, how long that took, and when, after its arrival, the decode was sent."""

    replica: str
    prefill_s: float
    decode_sent_s: float

    def legs(self, ttft_s: float, elapsed: float) -> dict[str, float]:
        """Its prefill, its transfer (the decode sent to its first byte) and its decode (that
        first byte to the end), in seconds."""
        return {
            "prefill": self.prefill_s,
            "transfer": max(0.0, ttft_s - self.decode_sent_s),
            "decode": max(0.0, elapsed - ttft_s),
        }


class Outcome:
    """What one attempt did, in one record: its facts for the routing core (`facts`: status, time
    to first token, tokens, whether it streamed, broke, or lost its client), the HTTP side a
    stream is relayed, resumed or ended through (the client's exchange, the framer, the transport,
    what was forwarded so far, whether it broke with the response left open), and its legs: where
    it broke and was resumed, whether it was resent on a new connection, how it was split."""

    __slots__ = (
        "_error", "broke_on", "broken", "facts", "framer", "record", "reply", "resent", "response", "resumed_on",
        "split", "transport",
    )  # fmt: skip

    def __init__(self, response: Exchange, facts: Served) -> None:
        self.response = response  # the client's side: the answer is given through it
        self.facts = facts
        self._error: str | None = None
        self.broke_on: str | None = None  # the replica its stream broke on (router.proxy.journey resumes it) ...
        self.resumed_on: str | None = None  # ... and the one that continued it
        self.resent = False  # sent again on a new connection (a stale pooled one: router.engines.upstream)
        self.split: Split | None = None  # prefilled elsewhere (router.proxy.disagg)
        # resuming: what was forwarded so far, and whether the stream broke with the response left open
        self.record: StreamRecord | None = None
        self.broken = False
        self.framer: StreamFramer | None = None  # a stream's framer, or its splicer once resumed
        self.transport: asyncio.Transport | None = None
        self.reply: str | None = None  # a whole chat answer's text (a stream's is read from its record)

    @property
    def stream_error(self) -> str | None:
        """Why the stream broke (None: it did not); the facts say whether it did."""
        return self._error

    @stream_error.setter
    def stream_error(self, error: str | None) -> None:
        self._error = error
        self.facts.cut = error is not None


@dataclass(slots=True)  # (not frozen: a frozen dataclass's __init__ costs three times as much, per request)
class Trip:
    """A request on its way to replicas: the client's side, what was taken in (its body, its kind,
    whether it is resumable), the headers it is forwarded with, and when it arrived (monotonic)."""

    exchange: Exchange
    intake: Intake
    headers: dict[str, str]
    t0: float
    streaming: Outcome | None = None  # the stream being relayed now: what passed, if the client leaves


@dataclass(frozen=True)
class Timeouts:
    connect_s: float  # making a connection (the upstream client's own timer; the rest is timed here)
    first_byte_s: float
    idle_s: float


def end_to_end(headers: Any, drop: frozenset[str]) -> dict[str, str]:
    """`headers` without `drop` and without the hop-by-hop headers their `Connection` headers name
    (every `Connection` header, not only the first)."""
    named = {h.strip().lower() for value in headers.getall("Connection", ()) for h in value.split(",")}
    return {k: v for k, v in headers.items() if k.lower() not in drop and k.lower() not in named}


# `Expect: 100-continue` was the client's business with the router, which has the whole body now
# Content-Type is set below, whatever case the client's had (the upstream client writes headers as given)
REQUEST_DROP = HOP_BY_HOP | {"accept-encoding", "content-encoding", "expect", "content-type"}


REQUEST_DROP_KEYS = REQUEST_DROP | KEY_HEADERS  # ... and a client's key to the API (router.tenancy.clients)


def forward_headers(headers: CIMultiDictProxy[str], remote: str | None, client_key: bool = True) -> dict[str, str]:
    """The headers a request is forwarded with; without `client_key`, the client's own key is not among them."""
    out = end_to_end(headers, REQUEST_DROP if client_key else REQUEST_DROP_KEYS)
    peer = remote or ""
    prior = next((v for k, v in out.items() if k.lower() == "x-forwarded-for"), None)  # unless hop-by-hop
    out = {k: v for k, v in out.items() if k.lower() != "x-forwarded-for"}
    out["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    out["Content-Type"] = "application/json"
    # streams are framed and usage is read, so replicas must not compress; and the body we send is
    # the decoded (or re-serialised) one, so the client's Content-Encoding no longer applies
    out["Accept-Encoding"] = "identity"
    return out


async def attempt(
    client: Upstream,
    trip: Trip,
    url: str,
    named: dict[str, str],
    timeouts: Timeouts,
    deadline: float,
    settle: bool = False,
) -> Retry | Outcome:
    """Send `trip` to `url` and relay the answer to its client, with the headers `named` added
    (which replica, which worker). A resumable request's stream has its forwarded bytes recorded
    (up to `intake.keep`), and a stream the replica breaks is left open (`broken`) for the caller
    to resume or end with `end_stream`. How a stream is framed follows the request's kind
    (router.apis `events`: `sse`; `responses`, whose events are `response.*` and whose answer has
    an id; `messages`, Anthropic's). `settle`: a stream is held until its second event, and one
    whose second event is an error (vLLM's answer to a decode whose KV transfer failed, after its
    opening event) is a `Retry` the client never sees."""
    # One timer per attempt, moved forward as the attempt progresses (asyncio.wait_for would
    # start a task per read: measurably slower per SSE event). `deadline` is on the loop clock.
    loop = asyncio.get_running_loop()
    upstream: Response | None = None
    outcome: Retry | Outcome | None = None
    try:
        try:
            async with asyncio.timeout_at(min(loop.time() + timeouts.first_byte_s, deadline)) as timer:
                upstream = await client.post(url, trip.intake.raw, trip.headers, timeouts.connect_s)
                if upstream.status >= 500:
                    timer.reschedule(min(loop.time() + timeouts.idle_s, deadline))
                    try:
                        data = await upstream.read()
                    except OSError:
                        data = b""
                    return Retry(
                        "http_5xx", upstream.status, data, upstream.headers.get("Content-Type", "application/json")
                    )
                # until the first body bytes arrive, failing over is invisible to the client
                first = await upstream.readany()
                if settle and first and upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                    while first.count(b"\n\n") < 2 and (more := await upstream.readany()):
                        first += more
                    if _errs_first(first):
                        return Retry("http_5xx", 500, first, "text/event-stream")
        except (TimeoutError, OSError) as exc:
            return _retry_for(exc)
        outcome = await _relay(trip, upstream, first, named, timeouts, deadline)
        if upstream.resent and isinstance(outcome, Outcome):
            outcome.resent = True  # (for the attempt's trace)
        return outcome
    finally:
        if upstream is not None:
            _let_go(upstream, _whole(outcome))


def _errs_first(head: bytes) -> bool:
    """Whether a stream's second event (after its opening one) is an in-band error."""
    events = head.split(b"\n\n", 2)
    return len(events) > 1 and events[1].lstrip().startswith((b'data: {"error"', b"event: error"))


def _framer(events: str, strip_usage: bool, tools: bool) -> StreamFramer:
    if events == "responses":
        return ResponsesFramer(tools)
    if events == "messages":
        return MessagesFramer(tools)
    return SseFramer(strip_usage, tools)


def _offers_tools(intake: Intake) -> bool:
    """Whether the request offered tools: only then can its answer call one (every API names them `tools`)."""
    return bool(intake.body.get("tools"))


def _retry_for(exc: BaseException) -> Retry:
    """What a failure before the first body byte means: time-out, unreachable, or reset."""
    if isinstance(exc, TimeoutError):
        return Retry("timeout", 504)
    if isinstance(exc, ConnectError):
        return Retry("connect", 502)
    return Retry("reset", 502)


def _let_go(upstream: Response, whole: bool) -> None:
    """Done with `upstream`; `whole`: the stream's own end (`[DONE]`, `message_stop`, ...) has passed."""
    if upstream.at_eof():
        upstream.release()  # read to the end: the keep-alive connection goes back to the pool
    elif whole:
        # its HTTP end follows (llama-server and vLLM write it apart): it is awaited off the
        # request, which is over for its client, who may close its connection at [DONE]; a request
        # that waited for it here was cancelled then, its whole answer counted as a 499 and its
        # session forgotten
        upstream.release_at_end(TAIL_WAIT_S)
    else:
        upstream.close()  # abandoned (client gone, error): the replica sees the request cancelled


def _whole(outcome: Retry | Outcome | None) -> bool:
    return isinstance(outcome, Outcome) and outcome.framer is not None and outcome.framer.done


async def _relay(
    trip: Trip, upstream: Response, first: bytes, named: dict[str, str], timeouts: Timeouts, deadline: float
) -> Retry | Outcome:
    loop = asyncio.get_running_loop()
    exchange, intake, t0 = trip.exchange, trip.intake, trip.t0
    events = intake.api.events
    content_type = upstream.headers.get("Content-Type", "")
    headers = end_to_end(upstream.headers, RESPONSE_DROP)
    headers.update(named)
    idle = timeouts.idle_s
    streaming = content_type.startswith("text/event-stream")
    if not first and streaming:
        return Retry("reset", 502)  # a stream that ended before its first byte: another replica may do better
    if not streaming:
        chunks = [first]
        try:
            if not upstream.at_eof():  # a small answer usually came whole with its head: no timer for it
                async with asyncio.timeout_at(None) as timer:
                    while chunks[-1]:
                        timer.reschedule(min(loop.time() + idle, deadline))
                        chunks.append(await upstream.readany())
        except TimeoutError:
            return Retry("timeout", 504)
        except OSError:
            return Retry("reset", 502)
        data = b"".join(chunks)
        if upstream.status >= 400 and not in_shape(exchange.path, data):  # what the client's SDK can read
            data = wrapped(exchange.path, upstream.status, data)
            headers = {k: v for k, v in headers.items() if k.lower() != "content-type"} | JSON
        exchange.answer(upstream.status, data, headers)
        outcome = Outcome(exchange, Served(upstream.status))
        outcome.facts.ttft_s = time.monotonic() - t0
        if upstream.status == 200 and content_type.startswith("application/json"):
            outcome.facts.tools = _offers_tools(intake) and calls_tools(data)
            try:
                answer = orjson.loads(data)
            except orjson.JSONDecodeError:
                answer = None
            usage = usage_of(answer)
            if intake.api is CHAT:
                outcome.reply = _answer_text(answer)
            if events == "responses" and isinstance(answer, dict) and isinstance(answer.get("id"), str):
                outcome.facts.response_id = answer["id"]
            if usage:
                outcome.facts.prompt_tokens, outcome.facts.cached_tokens, outcome.facts.completion_tokens = usage
        return outcome
    outcome = Outcome(exchange, Served(upstream.status, streamed=True))
    outcome.framer = _framer(events, intake.strip_usage, _offers_tools(intake))
    trip.streaming = outcome
    outcome.transport = exchange.transport
    if intake.keep > 0 and upstream.status == 200:
        outcome.record = StreamRecord(intake.keep)
    try:
        async with asyncio.timeout_at(deadline + FINAL_WRITE_GRACE_S):
            await exchange.prepare(upstream.status, headers)
    except ConnectionResetError:
        outcome.facts.client_gone = True
        return outcome
    except TimeoutError:
        outcome.stream_error = "the request's total time-out expired"
        if outcome.transport is not None:
            outcome.transport.abort()
        return outcome
    await _stream(upstream, outcome, first, idle, deadline, t0)
    return outcome


async def _stream(upstream: Response, outcome: Outcome, first: bytes, idle: float, deadline: float, t0: float) -> None:
    """Pump `upstream` through the outcome's framer into its prepared response. A break is left
    open (`broken`) for the caller when the outcome keeps a record (resuming is on); otherwise the
    stream is ended here."""
    framer = outcome.framer
    assert framer is not None
    try:
        # the whole request, client writes included; the grace lets an expired stream still send its error event
        async with asyncio.timeout_at(deadline + FINAL_WRITE_GRACE_S):
            await _pump(upstream, outcome, first, idle, deadline, t0)
            if not outcome.facts.client_gone:
                held = framer.release()  # a finish event waiting for a usage event that never came
                if held:
                    await outcome.response.write(held)
                    if outcome.record is not None:
                        outcome.record.add(held)
                tail = framer.pending()
                if outcome.stream_error is None and not framer.done:
                    outcome.stream_error = "upstream closed the stream early"
                if tail and outcome.stream_error is None:
                    await outcome.response.write(tail)  # the last event, sent without its blank line
                    if outcome.record is not None:
                        outcome.record.add(tail)
                resumable = outcome.record is not None  # the caller resumes it, or says why it cannot
                if outcome.stream_error and resumable and asyncio.get_running_loop().time() < deadline:
                    outcome.broken = True  # the caller resumes it elsewhere, or ends it
                else:
                    await end_stream(outcome)
    except ConnectionResetError:  # the client left while we wrote to it: nobody to tell
        outcome.facts.client_gone = True
    except TimeoutError:
        outcome.stream_error = outcome.stream_error or "the request's total time-out expired"
        outcome.broken = False
        if outcome.transport is not None:
            outcome.transport.abort()  # a client that stops reading cannot hold the replica's slot for ever
    if outcome.facts.client_gone:
        outcome.broken = False  # nobody to resume it for
    outcome.facts.events += framer.events  # (a continuation's framer counts its own: the legs add up)
    outcome.facts.tools = outcome.facts.tools or framer.tools
    if framer.usage:
        outcome.facts.prompt_tokens, outcome.facts.cached_tokens, outcome.facts.completion_tokens = framer.usage
    if isinstance(framer, ResponsesFramer):
        outcome.facts.response_id = framer.response_id


def reply_text(outcome: Outcome) -> str | None:
    """The text of a chat answer of one choice that ended well, as its client got it (a stream's,
    from its record: None where it kept none, as for a stream that cannot be resumed)."""
    if not outcome.facts.streamed:
        return outcome.reply
    return streamed_text(outcome.record) if outcome.record is not None else None


def _answer_text(answer: Any) -> str | None:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    text = message.get("content") if isinstance(message, dict) else None
    return text if isinstance(text, str) and text else None


async def end_stream(outcome: Outcome) -> None:
    """End the client's stream: with an SSE error event (and `[DONE]`) if it broke; a Responses
    API stream with that API's `error` event, numbered after the last one the client got; an
    Anthropic Messages stream with that API's `event: error`."""
    outcome.broken = False
    try:
        if outcome.stream_error:
            # a cut-off event is dropped, so the error event stands on its own
            framer = outcome.framer
            if isinstance(framer, ResponsesFramer):
                event = responses_error_event(outcome.stream_error, framer.next_sequence())
            elif isinstance(framer, MessagesFramer):
                event = messages_error_event(outcome.stream_error)
            else:
                event = sse_error_event(outcome.stream_error)
            await outcome.response.write(event)
        await outcome.response.write_eof()
    except ConnectionResetError:
        outcome.facts.client_gone = True


async def resume(
    client: Upstream,
    trip: Trip,
    url: str,
    body: bytes,
    timeouts: Timeouts,
    deadline: float,
    outcome: Outcome,
    splicer: StreamFramer,
) -> Retry | None:
    """Continue a broken stream from another replica into the same client response. A failure
    before the continuation's first byte is a `Retry` (the client has seen nothing new); after it,
    the outcome is broken again (resumable again) or ended, as with the first replica."""
    loop = asyncio.get_running_loop()
    upstream: Response | None = None
    try:
        try:
            async with asyncio.timeout_at(min(loop.time() + timeouts.first_byte_s, deadline)):
                upstream = await client.post(url, body, trip.headers, timeouts.connect_s)
                if upstream.status != 200 or not upstream.headers.get("Content-Type", "").startswith(
                    "text/event-stream"
                ):
                    # a 4xx refuses the continuation itself (the next replica would too): "refused"
                    cause = "http_5xx" if upstream.status >= 500 else "refused" if upstream.status >= 400 else "reset"
                    return Retry(cause, upstream.status)
                first = await upstream.readany()
        except (TimeoutError, OSError) as exc:
            return _retry_for(exc)
        if not first:
            return Retry("reset", 502)
        outcome.stream_error = None
        outcome.broken = False
        outcome.framer = splicer
        await _stream(upstream, outcome, first, timeouts.idle_s, deadline, trip.t0)
        return None
    finally:
        if upstream is not None:
            _let_go(upstream, outcome.framer is splicer and splicer.done)


_MESSAGE_OPENERS = (b"event: message_start", b"event: content_block_start", b"event: ping")


def _opener(out: bytes) -> bool:
    """Events that only open a stream (a chat's `"delta": {"role": "assistant", "content": ""}`,
    a Responses stream's `response.created` or `response.in_progress`, a Messages stream's
    `message_start`, `content_block_start` and `ping`): an engine may send them before its prefill
    is done (the emulator does), so they say nothing of TTFT."""
    if out.startswith(b"event: message_start") or out.startswith(b"event: content_block_start"):
        return all(e.startswith(_MESSAGE_OPENERS) for e in out.split(b"\n\n") if e.strip())
    if out.count(b"data:") != 1:
        return False
    if out.startswith(b"event: response."):
        return out.startswith((b"event: response.created", b"event: response.in_progress"))
    return b'"role"' in out and (b'"content":""' in out or b'"content": ""' in out)


async def _pump(upstream: Response, outcome: Outcome, chunk: bytes, idle: float, deadline: float, t0: float) -> None:
    """Upstream to client (the outcome's response, through its framer) until `[DONE]` or the end. The
    idle timer covers upstream reads only: it is moved only when a quarter of the idle time has passed
    since it was last set, to 1.25 x idle (a quiet upstream is cut between idle and 1.25 x idle after
    its last chunk, and a busy stream costs a clock read per chunk instead of a timer), and paused
    while a slow client drains a write."""
    resp, framer, transport, facts = outcome.response, outcome.framer, outcome.transport, outcome.facts
    assert framer is not None
    loop = asyncio.get_running_loop()
    slack = idle / 4
    try:
        async with asyncio.timeout_at(min(loop.time() + idle + slack, deadline)) as timer:
            moved = loop.time()
            while chunk:
                out = framer.feed(chunk)
                if out:
                    if outcome.record is not None:
                        outcome.record.add(out)
                    if transport is not None and transport.get_write_buffer_size():
                        timer.reschedule(deadline)  # the client is slow: that is not upstream silence
                        moved = -idle
                    try:
                        await resp.write(out)
                    except ConnectionResetError:  # the client left: stop reading the replica's stream
                        facts.client_gone = True
                        return
                    if facts.token_s is None:
                        since = time.monotonic() - t0
                        if facts.ttft_s is None:
                            facts.ttft_s = since
                        if not _opener(out):
                            facts.token_s = since
                if framer.done:
                    break
                now = loop.time()
                if now - moved > slack:
                    timer.reschedule(min(now + idle + slack, deadline))
                    moved = now
                chunk = await upstream.readany()
    except TimeoutError:
        if not framer.done:
            outcome.stream_error = (
                "the request's total time-out expired"
                if loop.time() >= deadline
                else "upstream stopped sending (idle time-out)"
            )
    except OSError:
        if not framer.done:
            outcome.stream_error = "upstream connection lost mid-stream"
