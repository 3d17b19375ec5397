"""Admin REST API under /admin/: replicas, drain, route explanation, ring shares.

Every route needs `Authorization: Bearer <admin token>` (compared in constant time); without a
configured token the whole API is off (404). Request and response bodies are JSON; errors use
the OpenAI error shape like the rest of the router.
"""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any
from urllib.parse import unquote_to_bytes

import aiohttp
import orjson
from aiohttp import web

from router.apis import CHAT, COMPLETION, MESSAGES, RESPONSES
from router.config import parse_replica
from router.fleet import ReplicaState
from router.keys import RoutingKey, bounded_key
from router.membership import Clash, NoRoom
from router.node import Node
from router.pools import Pool
from router.routing.request import Keys
from router.web import error_response


def add_admin_routes(app: web.Application, node: Node, replica_routes_only: bool = False) -> None:
    """The admin routes. In a worker process, the replica and override routes go to the control
    process, which owns membership and the ring; route explanation and ring shares are answered
    from the worker's own copy of the ring, which is the one its requests are routed by."""
    api = AdminApi(node)
    replicas = api.forward if node.follower is not None else None
    app.router.add_get("/admin/replicas", api.guard(replicas or api.list_replicas))
    app.router.add_post("/admin/replicas", api.guard(replicas or api.add_replica))
    app.router.add_delete("/admin/replicas/{id}", api.guard(replicas or api.remove_replica))
    app.router.add_post("/admin/replicas/{id}/drain", api.guard(replicas or api.drain_replica))
    app.router.add_post("/admin/overrides", api.guard(replicas or api.set_override))
    app.router.add_delete("/admin/overrides/{origin}/{vnode}", api.guard(replicas or api.clear_override))
    app.router.add_get("/admin/scale", api.guard(replicas or api.scale))
    if not replica_routes_only:
        app.router.add_get("/admin/route", api.guard(api.explain_route))
        app.router.add_post("/admin/route", api.guard(api.explain_request))
        app.router.add_get("/admin/ring", api.guard(api.ring_shares))


def token_ok(request: web.Request, token: str) -> bool:
    """The request carries `Authorization: Bearer <token>` (compared in constant time), once: two
    Authorization headers are refused, whatever their order."""
    given = request.headers.getall("Authorization", [])
    if len(given) != 1:
        return False
    scheme, _, value = given[0].partition(" ")
    offered = value.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(offered, token.encode())


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


class AdminApi:
    def __init__(self, node: Node) -> None:
        self.node = node

    def guard(self, handler: Any) -> Any:
        async def guarded(request: web.Request) -> web.StreamResponse:
            token = self.node.config.admin_token
            if not token:
                return error_response(
                    "the admin API is disabled: set ROUTER_ADMIN_TOKEN or admin_token", 404, "not_found"
                )
            if not token_ok(request, token):
                return error_response(
                    "missing or wrong admin token", 401, "invalid_admin_token", headers={"WWW-Authenticate": "Bearer"}
                )
            response: web.StreamResponse = await handler(request)
            return response

        return guarded

    def _replica_json(self, r: ReplicaState) -> dict[str, Any]:
        pool = self.node.pool_of(r)
        fleet, placement = pool.fleet, pool.placement
        index = r.index
        return {
            "id": r.id,
            "url": r.url,
            "role": r.role,
            "state": r.state,
            "weight": fleet.ring.weights[index] if index is not None else 0.0,
            "inflight": r.inflight,
            "requests": r.requests,
            "errors": r.errors,
            "hit_rate": r.hit_rate,
            "score": r.health.score,
            "state_changes": r.health.transitions,
            "relapses": r.health.relapses,
            "return_needed": r.health.return_needed,
            "agent": r.agent,
            "capacity": r.capacity,
            "models": sorted(r.models) if r.models is not None else None,  # None: unknown (may serve any)
            "adapters": sorted(r.adapters) if r.adapters is not None else None,  # loaded now; None: not said
            "max_lora": r.max_lora,
            "engine": dataclasses.asdict(r.engine),
            "prefix_index": self._index_json(r, pool),
            # what its engine's KV-cache events say it holds (router.engines.kvfeed); None: it publishes none
            "kv_events": placement.truth.figures(r.id) if placement is not None else None,
            "inputs": dataclasses.asdict(r.inputs) if r.inputs is not None else None,
            "ring_share": fleet.ring.shares()[index] if index is not None else 0.0,
            "slow_start_since": self.node.membership.warming_since.get(r.id) if r.state == "warming" else None,
        }

    @staticmethod
    def _index_json(r: ReplicaState, pool: Pool) -> dict[str, Any] | None:
        """What the prefix index keeps for the replica (its pool's `ttft` policy's): the blocks its
        engine's KV holds, as the index counts them (the engine's own figure when it reports one),
        the blocks it may keep now and those it keeps. None with a policy that keeps no index, or
        before the replica's first decision."""
        placement = pool.placement
        held = placement.held.get(r.id) if placement is not None else None
        if placement is None or held is None:
            return None
        return {
            "block_bytes": placement.block_bytes,
            "engine_blocks": held.engine_blocks,
            "kv_tokens_source": "engine" if r.engine.kv_tokens is not None else "configured",
            "capacity_blocks": held.blocks,
            "blocks": placement.index.size(held.holder),
        }

    async def forward(self, request: web.Request) -> web.Response:
        """Hand a replica route to the control process and relay its answer (worker processes)."""
        control = self.node.control
        assert control is not None
        try:
            async with control.request(
                request.method,
                "http://control" + request.raw_path,  # as sent: %2F in an id stays in the id
                data=await request.read(),
                headers={"Authorization": request.headers.get("Authorization", "")},
                timeout=aiohttp.ClientTimeout(total=10),
            ) as resp:
                body = await resp.read()
                status, content_type = resp.status, resp.content_type
        except (aiohttp.ClientError, OSError, TimeoutError):
            return error_response("the router's control process is not answering", 503, "control_process_unavailable")
        self.node.follow()  # this worker sees its own change before it answers
        return web.Response(status=status, body=body, content_type=content_type)

    async def scale(self, request: web.Request) -> web.Response:
        """The scale signal, for an autoscaler that reads JSON (KEDA's metrics-api scaler): the
        replicas the load needs (router_scale_recommended_replicas), the requests held now, and
        whether the fleet has been idle for a window."""
        balancer = self.node.balancer
        held = balancer.held()
        return _json({"recommended_replicas": balancer.recommended, "held": held, "idle": balancer.idle})

    async def list_replicas(self, request: web.Request) -> web.Response:
        self.node.gather()
        every = [r for pool in self.node.pools for r in pool.fleet.replicas]  # the route's first, prefill last
        return _json([self._replica_json(r) for r in every])

    async def add_replica(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return error_response("the request body is not valid JSON")
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            return error_response('expected {"url": "http://host:port"} (and optionally "id")', param="url")
        text = body["url"] if not isinstance(body.get("id"), str) else f"{body['id']}={body['url']}"
        try:
            spec = parse_replica(text)
        except ValueError as exc:
            return error_response(str(exc), param="url")
        shown: list[dict[str, Any]] = []  # the replica as it was added, before warm-up and moves
        try:
            _, moved, warming = await self.node.membership.add(
                spec, seen=lambda replica: shown.append(self._replica_json(replica))
            )
        except NoRoom as exc:
            return error_response(str(exc), 507, "insufficient_storage")
        except Clash as exc:
            return error_response(str(exc), 409 if "already" in str(exc) else 400, param="url")
        answer = shown[0]
        return _json(answer | {"moved_share": sum(m.width for m in moved) / 2**64, "sessions_to_warm": warming}, 201)

    async def remove_replica(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        try:
            moved = self.node.membership.remove(rid)
        except KeyError:
            return error_response(f"no replica {rid!r}", 404, "not_found")
        return _json({"removed": rid, "moved_share": sum(m.width for m in moved) / 2**64})

    async def drain_replica(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        remove = request.query.get("remove", "false").lower()
        if remove not in ("true", "false", "1", "0"):
            return error_response("remove must be true or false", param="remove")
        removing = remove in ("true", "1")
        shown: list[dict[str, Any]] = []  # the replica as its drain began, before the moves
        try:
            _, moving = await self.node.membership.drain(
                rid, removing, seen=lambda replica: shown.append(self._replica_json(replica))
            )
        except KeyError:
            return error_response(f"no replica {rid!r}", 404, "not_found")
        return _json(shown[0] | {"sessions_to_move": moving, "remove": removing})

    async def set_override(self, request: web.Request) -> web.Response:
        """Hand one vnode to another replica: {"origin": id, "vnode": n, "owner": id}."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return error_response("the request body is not valid JSON")
        ring = self.node.fleet.ring
        if not (
            isinstance(body, dict)
            and isinstance(body.get("origin"), str)
            and isinstance(body.get("owner"), str)
            and isinstance(body.get("vnode"), int)
            and not isinstance(body.get("vnode"), bool)
        ):
            return error_response('expected {"origin": replica id, "vnode": number, "owner": replica id}')
        origin, number, owner = body["origin"], body["vnode"], body["owner"]
        for rid in (origin, owner):
            if rid not in ring.replica_ids:
                return error_response(f"no replica {rid!r}", 404, "not_found")
        if not 0 <= number < ring.vnodes:
            return error_response(f"vnode must be in 0..{ring.vnodes - 1}", param="vnode")
        moved = self.node.membership.override(origin, number, owner)
        share = sum(m.width for m in moved) / 2**64
        return _json({"origin": origin, "vnode": number, "owner": owner, "moved_share": share})

    async def clear_override(self, request: web.Request) -> web.Response:
        origin, vnode = request.match_info["origin"], request.match_info["vnode"]
        ring = self.node.fleet.ring
        if origin not in ring.replica_ids or not vnode.isdigit() or (origin, int(vnode)) not in ring.overrides:
            return error_response(f"no override of {origin}#{vnode}", 404, "not_found")
        self.node.membership.override(origin, int(vnode), None)
        return _json({"origin": origin, "vnode": int(vnode), "owner": None})

    async def explain_route(self, request: web.Request) -> web.Response:
        # the key's raw bytes, percent-decoded: a session key need not be UTF-8
        raw_key = next(
            (
                unquote_to_bytes(v)
                for k, _, v in (part.partition("=") for part in request.rel_url.raw_query_string.split("&"))
                if unquote_to_bytes(k) == b"key"
            ),
            b"",
        )
        if not raw_key:
            return error_response("give the routing key as ?key=...", param="key")
        node = self.node
        fleet, ring, policy = node.fleet, node.fleet.ring, node.policy
        model = request.query.get("model") or None  # as a request naming this model would go
        key = RoutingKey(bounded_key(raw_key, node.config.max_key_bytes), "header", "query", model=model)
        unserved = fleet.unserved(model)
        # as a request's route decides it, nothing counted (round_robin and least_load explain
        # nothing: they ignore keys, and asking them would move their rotation)
        explained, last = await node.routing.explain(key)
        decision = explained.decision if not unserved else None
        skip = fleet.not_serving(model)
        located = ring.locate(key.key)
        cap = ring.load_cap(fleet.loads, node.config.bounded_load_c) if len(fleet) else 0
        limit = fleet.load_limit(cap, node.config.bounded_load_floor)
        walk = []
        for i in ring.successors(key.key):
            r = fleet.replicas[i]
            own = limit if isinstance(limit, int) else limit.of(i)  # the floor, and its capacity where known
            walk.append(
                {
                    "replica": r.id,
                    "state": r.state,
                    "inflight": r.inflight,
                    "load_cap": own,
                    "over_load_cap": fleet.loads[i] >= own,
                    "serves_model": i not in skip,
                }
            )
            if decision is not None and i == decision.index:
                break
        return _json(
            {
                "key": raw_key.decode("utf-8", "backslashreplace"),
                "replica": fleet.replicas[decision.index].id if decision else None,
                "reason": decision.reason
                if decision
                else (
                    f"no replica serves the model {model!r}"
                    if unserved
                    else "no replica can serve"
                    if policy.keyed
                    else f"the {policy.name} policy does not route by key"
                ),
                "policy": policy.name,
                "model": model,
                "hash": ring.key_hash(key.key),
                "vnode": None if located is None else {"origin": fleet.replicas[located[1]].id, "number": located[2]},
                "ring_owner": None if located is None else fleet.replicas[located[0]].id,
                "sticky": last,
                "load_cap": cap,
                "walk": walk,
                "worker": node.worker,
            }
        )

    async def explain_request(self, request: web.Request) -> web.Response:
        """Where a request with this body (and this request's session headers) would go, and why:
        under `ttft`, every candidate's predicted cached tokens, wait and cost. Nothing is sent,
        and nothing is counted in flight."""
        node = self.node
        cfg = node.config
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return error_response(f"the body must be the JSON of a completion request: {exc}")
        if not isinstance(body, dict):
            return error_response("the body must be a JSON object: the request to explain")
        # the request's API by its fields (this path is not the API's), its key as the router reads it
        api = (MESSAGES if "system" in body else CHAT) if "messages" in body else COMPLETION
        if "previous_response_id" in body or "input" in body:
            api = RESPONSES
        key = Keys.of(cfg, node.policy.reads_prompts).request(api, request.headers, body)
        fleet = node.fleet
        answer: dict[str, Any] = {
            "policy": node.policy.name,
            "key_kind": key.kind,
            "key_source": key.source,
            "model": key.model,
        }
        if fleet.unserved(key.model):
            last, _ = await node.directory.last_served(key.key, remember=False) if key.kind != "none" else (None, False)
            return _json(
                answer | {"sticky": last, "replica": None, "reason": f"no replica serves the model {key.model!r}"}
            )
        if node.feed is not None and key.prompt is not None:  # in the engine's tokens, where replicas publish KV events
            key = node.feed.tokenized(key, api, body)
        explained, last = await node.routing.explain(key)
        answer["sticky"] = last
        decision = explained.decision
        answer |= explained.details
        answer["replica"] = fleet.replicas[decision.index].id if decision else None
        answer["reason"] = decision.reason if decision else "no replica can serve"
        return _json(answer)

    async def ring_shares(self, request: web.Request) -> web.Response:
        ring = self.node.fleet.ring
        shares = ring.shares()
        return _json(
            {
                "worker": self.node.worker,
                "vnodes": ring.vnodes,
                "seed": ring.seed,
                "points": ring.size,
                "replicas": [
                    {"id": r.id, "state": r.state, "share": shares[i]} for i, r in enumerate(self.node.fleet.replicas)
                ],
            }
        )
