"""Locust users that hold multi-turn chat sessions against any OpenAI-compatible endpoint.

Each user opens a session (a fresh id in `X-Session-ID`), sends its first message, then keeps
appending the reply and a new message and resending the whole history, with a think time
between turns; after its last turn it starts a new session. A share of the turns is streamed
(`stream: true`), the rest not. Reported per turn kind ("chat stream" / "chat"): the total time
of each request, and for streams also "TTFT", the time to the first content chunk.

A request fails when the status is not 200, the body is not a completion, or a stream ends
without `data: [DONE]` or carries an error event (a broken stream is never counted as a success).

Options (command line, or LOCUST_<NAME> environment variables):
  --model NAME           model to ask for (default emulated-llm; "" sends none)
  --turns MIN-MAX        turns per session (default 2-6)
  --think-min/--think-max S   think time between turns, seconds (default 1-5)
  --stream-share X       share of turns streamed (default 0.8)
  --max-tokens N         max_tokens of each turn (default 64)
  --prompt-words N       words of the first message (default 200)

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8080 --headless -u 20 -r 5 -t 2m
"""

from __future__ import annotations

import json
import random
import time
import uuid
from typing import Any

from locust import HttpUser, between, events, task
from locust.env import Environment

WORDS = ["the", "a", "router", "replica", "cache", "session", "token", "model", "prompt", "reply", "fleet", "latency"]


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument(
        "--model", env_var="LOCUST_MODEL", default="emulated-llm", help="model to ask for ('' sends none)"
    )
    parser.add_argument("--turns", env_var="LOCUST_TURNS", default="2-6", help="turns per session, MIN-MAX")
    parser.add_argument(
        "--think-min", env_var="LOCUST_THINK_MIN", type=float, default=1.0, help="shortest think time, s"
    )
    parser.add_argument(
        "--think-max", env_var="LOCUST_THINK_MAX", type=float, default=5.0, help="longest think time, s"
    )
    parser.add_argument(
        "--stream-share", env_var="LOCUST_STREAM_SHARE", type=float, default=0.8, help="share of turns streamed"
    )
    parser.add_argument(
        "--max-tokens", env_var="LOCUST_MAX_TOKENS", type=int, default=64, help="max_tokens of each turn"
    )
    parser.add_argument(
        "--prompt-words", env_var="LOCUST_PROMPT_WORDS", type=int, default=200, help="words of the first message"
    )


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


class ChatUser(HttpUser):
    """One conversation at a time, each turn resending the whole history."""

    wait_time = between(1.0, 5.0)  # replaced from the options when the user starts

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.rng = random.Random()
        self.model = getattr(opts, "model", "emulated-llm")
        low, _, high = str(getattr(opts, "turns", "2-6")).partition("-")
        self.turn_range = (int(low), int(high or low))
        self.stream_share = float(getattr(opts, "stream_share", 0.8))
        self.max_tokens = int(getattr(opts, "max_tokens", 64))
        self.prompt_words = int(getattr(opts, "prompt_words", 200))
        think = (float(getattr(opts, "think_min", 1.0)), float(getattr(opts, "think_max", 5.0)))
        self.wait_time = lambda: self.rng.uniform(*think)  # type: ignore[method-assign]
        self._new_session()

    def _new_session(self) -> None:
        self.session = f"locust-{uuid.uuid4().hex[:12]}"
        self.turns_left = self.rng.randint(*self.turn_range)
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": _words(self.rng, self.prompt_words)},
        ]

    @task
    def turn(self) -> None:
        stream = self.rng.random() < self.stream_share
        body: dict[str, Any] = {"messages": self.messages, "max_tokens": self.max_tokens, "stream": stream}
        if self.model:
            body["model"] = self.model
        headers = {"X-Session-ID": self.session, "Content-Type": "application/json"}
        reply = self._stream(body, headers) if stream else self._plain(body, headers)
        self.turns_left -= 1
        if reply is None or self.turns_left <= 0:
            self._new_session()  # a failed turn ends the conversation, as a user would give up
            return
        self.messages.append({"role": "assistant", "content": reply})
        self.messages.append({"role": "user", "content": _words(self.rng, self.rng.randint(5, 40))})

    def _plain(self, body: dict[str, Any], headers: dict[str, str]) -> str | None:
        with self.client.post(
            "/v1/chat/completions", data=json.dumps(body), headers=headers, name="chat", catch_response=True
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return None
            try:
                content = resp.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                resp.failure(f"not a chat completion: {resp.text[:200]}")
                return None
            resp.success()
            return str(content)

    def _stream(self, body: dict[str, Any], headers: dict[str, str]) -> str | None:
        t0 = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        with self.client.post(
            "/v1/chat/completions",
            data=json.dumps(body),
            headers=headers,
            name="chat stream",
            stream=True,
            catch_response=True,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return None
            done = False
            try:
                for line in resp.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        resp.failure(f"error event: {event['error'].get('message')}")
                        return None
                    for choice in event.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            if first is None:
                                first = time.perf_counter()
                            parts.append(piece)
            except (ValueError, OSError) as exc:  # a cut connection, a malformed event
                resp.failure(f"stream broken: {type(exc).__name__}: {exc}")
                return None
            # the whole stream's time, not the headers' (locust stops its clock when they arrive)
            resp.request_meta["response_time"] = (time.perf_counter() - t0) * 1000
            if not done:
                resp.failure("the stream ended without [DONE]")
                return None
            resp.success()
        if first is not None:
            self.environment.events.request.fire(
                request_type="TTFT",
                name="chat stream",
                response_time=(first - t0) * 1000,
                response_length=0,
                exception=None,
                context={},
            )
        return "".join(parts)


@events.test_stop.add_listener
def _summary(environment: Environment, **_: Any) -> None:
    """One line a script can check: requests, failures."""
    total = environment.stats.total
    print(f"loadtest: {total.num_requests} requests, {total.num_failures} failures")
