"""The APIs the router proxies, each described once: what the rest of the router asks of a request's kind.

A request's kind follows from its path alone, and decides:
- `prompt`: its prompt is computed into the replica's KV cache, so the prefix index reads it and
  warm-up may replay it (an embedding's input or a token count leaves nothing cached);
- `usage_option`: a stream that did not ask for usage may be asked for it (`stream_options`, OpenAI's
  chat and completions; the others always report usage);
- `resumable`: a stream broken mid-way can be continued on another replica (router.proxy.resume);
- `events`: how its stream is framed and read (`sse`: `data:` events ending in `[DONE]`;
  `responses`: `event: response.*`; `messages`: Anthropic's `event: message_*`);
- `anthropic`: its errors, and a broken stream's last event, take Anthropic's shape rather than OpenAI's;
- `queued`: it takes a place in the engine's batch, so overload admission holds it (a token count
  does not: the server answers it without the engine).

    path                         name          prompt usage_option resumable events    anthropic queued
    /v1/chat/completions         chat          yes    yes          yes       sse       no        yes
    /v1/completions              completion    yes    yes          yes       sse       no        yes
    /v1/embeddings               embedding     no     no           no        sse       no        yes
    /v1/responses                responses     no     no           no        responses no        yes
    /v1/messages                 messages      yes    no           no        messages  yes       yes
    /v1/messages/count_tokens    count_tokens  no     no           no        messages  yes       no
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Api:
    name: str
    path: str
    prompt: bool
    usage_option: bool
    resumable: bool
    events: str  # sse | responses | messages
    anthropic: bool
    queued: bool = True


CHAT = Api("chat", "/v1/chat/completions", True, True, True, "sse", False)
COMPLETION = Api("completion", "/v1/completions", True, True, True, "sse", False)
EMBEDDING = Api("embedding", "/v1/embeddings", False, False, False, "sse", False)
RESPONSES = Api("responses", "/v1/responses", False, False, False, "responses", False)
MESSAGES = Api("messages", "/v1/messages", True, False, False, "messages", True)
COUNT_TOKENS = Api("count_tokens", "/v1/messages/count_tokens", False, False, False, "messages", True, queued=False)

PROXIED = {api.path: api for api in (CHAT, COMPLETION, EMBEDDING, RESPONSES, MESSAGES, COUNT_TOKENS)}


def api_of(path: str) -> Api | None:
    """The proxied API served at `path`, if any."""
    return PROXIED.get(path)


def anthropic(path: str) -> bool:
    """Whether an answer on `path` takes Anthropic's error shape: the Messages API and anything
    under it (a method or path the router does not serve there included)."""
    return path == MESSAGES.path or path.startswith(MESSAGES.path + "/")
