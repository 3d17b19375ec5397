"""What the routing core reads of a request, below HTTP: its routing key, and the prompt's blocks.

A proxied request's key comes from its headers and body by the configured sources (router.keys):
a Responses API request continuing a stored response (`previous_response_id`) is keyed by that
response, which lives on the replica that produced it; any other by a coding agent's session
headers, its session header or body field, else a fingerprint of its first message. A policy
that reads prompts (`ttft`) gets the prompt's blocks on the key too (router.prompt). The proxy's
intake and /admin/route's explanation both key requests here, so an explanation keys a request
as its route would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from router.apis import RESPONSES, Api
from router.config import RouterConfig
from router.keys import RoutingKey, response_key, routing_key
from router.prompt import prompt_of


def session_key(headers: Mapping[str, str], body: dict[str, Any], cfg: RouterConfig) -> RoutingKey:
    """The session key of a request with these headers and this (parsed) body, by the configured sources."""
    return routing_key(
        headers,
        body,
        header_names=cfg.key_headers,
        body_fields=cfg.key_body_fields,
        prefix_chars=cfg.prefix_chars,
        max_key_bytes=cfg.max_key_bytes,
        agents=cfg.agent_session_headers,
    )


def request_key(
    api: Api,
    headers: Mapping[str, str],
    body: dict[str, Any],
    cfg: RouterConfig,
    prompts: bool = False,
    tenant: str | None = None,
) -> RoutingKey:
    """The routing key of a request to `api`; `prompts`: with the prompt's blocks (an embedding's
    input leaves no KV cache behind: none); `tenant`: whose it is, with client keys on (a stored
    response it continues is looked for in that tenant's name)."""
    stored = response_key(body, cfg.max_key_bytes, tenant) if api is RESPONSES else None
    key = stored or session_key(headers, body, cfg)
    if prompts and api.prompt:
        prompt = prompt_of(body, cfg.prefix_block_bytes)
        if prompt is not None:
            key = replace(key, prompt=prompt)
    return key
