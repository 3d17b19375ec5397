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
from dataclasses import dataclass, replace
from typing import Any

from router.apis import RESPONSES, Api
from router.config import RouterConfig
from router.config.groups import SessionSettings
from router.keys import RoutingKey, response_key, routing_key
from router.prompt import prompt_of


@dataclass(frozen=True)
class Keys:
    """How requests' routing keys are read: the sessions' sources, and the prompt's blocks for a
    policy that reads them."""

    sessions: SessionSettings
    block_bytes: int = 0  # the prompt's block (prefix_block_bytes); 0: the keys carry no prompt

    @classmethod
    def of(cls, config: RouterConfig, prompts: bool = False) -> Keys:
        """As `config` says; `prompts`: the policy reads prompts (its keys carry their blocks)."""
        return cls(config.sessions, config.prefix_block_bytes if prompts else 0)

    def session(self, headers: Mapping[str, str], body: dict[str, Any]) -> RoutingKey:
        """The session key of a request with these headers and this (parsed) body."""
        cfg = self.sessions
        return routing_key(
            headers,
            body,
            header_names=cfg.key_headers,
            body_fields=cfg.key_body_fields,
            prefix_chars=cfg.prefix_chars,
            max_key_bytes=cfg.max_key_bytes,
            agents=cfg.agent_session_headers,
        )

    def request(
        self, api: Api, headers: Mapping[str, str], body: dict[str, Any], tenant: str | None = None
    ) -> RoutingKey:
        """The routing key of a request to `api` (with the prompt's blocks where they are read: an
        embedding's input leaves no KV cache behind, none); `tenant`: whose it is, with client keys
        on (a stored response it continues is looked for in that tenant's name)."""
        stored = response_key(body, self.sessions.max_key_bytes, tenant) if api is RESPONSES else None
        key = stored or self.session(headers, body)
        if self.block_bytes and api.prompt:
            prompt = prompt_of(body, self.block_bytes)
            if prompt is not None:
                key = replace(key, prompt=prompt)
        return key
