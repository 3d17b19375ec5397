"""What each setting means, once, in the groups `router-serve --help` shows them in (the everyday
ones first). Each setting's default and type are its field's in router.config.settings; the help
text's "(default ...)" and docs/router.md's settings table are held to them by a test
(tests/unit/test_config.py), and every setting is in exactly one group.
"""

from __future__ import annotations

from router.config.settings import TLS_FILES

HELP = {
    "host": "address to bind (default 127.0.0.1)",
    "port": "port to listen on (default 8080)",
    "policy": "ttft (default: placement by predicted time to first token, from a prefix index of what each "
    "replica holds and its prefill queue), affinity (sticky sessions on the ring), consistent_hash, round_robin, "
    "least_load, or lmetric (a baseline: LMetric's new prefill tokens x batch size)",
    "vnodes": "virtual nodes per replica (default 128)",
    "hash_seed": "ring hash seed (default 0); changing it remaps every session",
    "bounded_load_c": "bounded-load factor c >= 1 (default 1.25)",
    "bounded_load_floor": "a replica with fewer requests in flight than this (and than its capacity, where known) "
    "is never passed over for load (default 8)",
    "replica_capacity": "comma-separated REPLICA_ID=N (or *=N for the rest): requests a replica runs at once, "
    "where its engine does not report it; load caps and the floor scale with it (default: as reported, else unknown)",
    "max_queued": "requests held at most while every replica for their model is full (its engine's queue at "
    "full_waiting, or its KV cache at full_kv_usage); past it, or past queue_timeout_s, a 429 with Retry-After "
    "(default auto: as many as the fleet's engines run at once, by their reported or configured capacity, else "
    "what each ran when it last queued, else 16 each; 0: off, everything is forwarded at once)",
    "queue_timeout_s": "the longest a held request waits for room before its 429 (default 10)",
    "ttft_target_ms": "with max_queued auto, a request's time-to-first-token target (its tenant's ttft_target_ms "
    "or its x-slo-ttft-ms instead): it is held only while it can start within half of it, from the "
    "service rate the router measures, and an engine is full at what it starts in a quarter of it (default 2000)",
    "full_waiting": "a replica is full once its engine's queue (probed, plus what was sent since) reaches this "
    "(default 8)",
    "full_kv_usage": "or once its KV cache usage reaches this share (default 0.95)",
    "replica_models": "comma-separated REPLICA_ID=MODEL (or *=MODEL for the rest), one model each: the models "
    "(and adapters) a replica serves, where its engine's /v1/models does not say (default: as listed there)",
    "capacity_caps": "bounded-load caps and the floor respect replicas' capacities: a full replica spills while "
    "another has a free slot (default on; off: capacity-blind, as before)",
    "prefix_block_bytes": "ttft: bytes of prompt per block of the prefix index, 16..240 (default 64, about 16 tokens)",
    "kv_capacity_tokens": "ttft: comma-separated REPLICA_ID=TOKENS (or *=TOKENS for the rest): the KV cache's size "
    "where the engine does not report it (vLLM and SGLang do; default 262144)",
    "kv_events": "read the KV-cache events of every replica that publishes them (vLLM with --kv-events-config, "
    "found through its /kv_event_sources, or named in kv_event_endpoints) and price it by what its engine "
    "holds; off: the router's own model of what it sent everywhere (default on)",
    "kv_event_endpoints": "comma-separated REPLICA_ID=ENDPOINT or REPLICA_ID=ENDPOINT;REPLAY_ENDPOINT (ZMQ, "
    "tcp://HOST:PORT): where a replica publishes its KV-cache events, where its /kv_event_sources does not say",
    "kv_events_max_mib": "the event-fed index's memory at most, in MiB, each followed engine counted at its KV "
    "capacity (68 bytes a block; 240 under ROUTER_NO_EXTENSIONS=1); a replica that would take it past this is "
    "not followed and is priced by the router's model (router_kv_events_unfollowed); 0 (default): a quarter of "
    "this host's memory, or of its container's limit (under --workers, the control process's, and no more than "
    "the room in /dev/shm; each worker has a share of it)",
    "kv_event_followers": "under --workers, the processes that follow the engines' KV-cache events into the "
    "host's shared index, each a shard of the replicas (by a hash of the replica's id): 1 (default) is the "
    "control process alone; N adds N - 1 processes of their own, for a fleet whose events are more than one "
    "core applies (about 400,000 stored blocks a second: some 300 H200-shaped replicas); kv_events_max_mib "
    "is split among them",
    "tokenizer_dirs": "comma-separated MODEL=DIR (or *=DIR): a model's folder with tokenizer.json and its chat "
    "template, named by hand; without it the tokenizer is found from the root each engine's /v1/models lists "
    "(a folder, or a Hugging Face hub name through huggingface_hub)",
    "token_check_share": "share of the requests tokenized here whose tokens are checked again, in the background, "
    "against the engine's (render where served, else /tokenize; default 0.01; a tokenizer is checked once "
    "before it is used)",
    "kv_tier_tokens_per_s": "tokens a second a second KV tier (vLLM --kv-offloading-size, SGLang HiCache) "
    "loads back: blocks held there are priced as that transfer (default 200000)",
    "prefill_tokens_per_s": "ttft: a replica's prefill speed until its answers show it (default 10000)",
    "ttft_decode_s": "ttft: seconds of time to first token each request in flight on a replica adds (default 0.002)",
    "ttft_interference": "ttft: a prefill's time counts once more, times this, for each request in flight on the "
    "replica (each of them is delayed by it; default 1, 0 turns it off)",
    "ttft_spread_tokens": "ttft: a new conversation costs this many more tokens of prefill on a replica whose "
    "recent traffic is past the fleet's mean, times (recent - mean) / (mean + 4) and the share of the prompt it "
    "would compute (its later turns will load it; default 2000); a chat with no assistant turn yet is charged "
    "whole, and at least the tokens of its earlier messages the replica holds",
    "ttft_gate_c": "ttft: never a replica with more in flight than max(ceil(c x (in flight + 1) / replicas), "
    "ceil((in flight + 1) / replicas) + bounded_load_floor), c >= 1 (default 1.5)",
    "ttft_stay_share": "ttft: the replica holding a conversation (a keyed session's, or one holding half a keyless "
    "prompt) keeps it unless another costs less than 1 / (1 + this) of its cost (default 1: half; 0 turns it off)",
    "ttft_move_weight": "ttft: a keyed session's replica, not past the gate, keeps it unless moving saves more than "
    "ttft_stay_share x the other's cost plus this times the move's price to the fleet: the history recomputed "
    "there, once for itself and once for each request in flight or queued there, and the context of others it "
    "evicts there (default 1; 0: the stay share alone)",
    "ttft_move_cooldown_s": "ttft: a session moved by cost makes no other such move for this many seconds, and none "
    "back to the replica it left while its move is remembered (sticky_ttl_s) (default 60)",
    "ttft_tie_s": "ttft: costs within this many seconds of the cheapest count as equal: the least full of them, "
    "then the ring, breaks the tie (default 0.001)",
    "ttft_tie_share": "ttft: ... or within this share of the cheapest cost (default 0.1)",
    "adapter_load_s": "ttft: seconds added to the cost of a replica without a requested LoRA adapter that other "
    "replicas have loaded (default 0.25; affinity prefers those replicas under their load cap)",
    "ttft_kv_wait": "ttft: a replica whose requests in flight (prompts and expected replies) fill its KV cache "
    "costs the wait for room: the tokens past its capacity, drained a capacity's worth every reply time "
    "(default on)",
    "ttft_queue_gain": "ttft: a streamed answer's first token later (or sooner) than the model predicted moves "
    "the predicted drain of its replica's queue by this share of the lag (default 0.5; 0 turns it off)",
    "sticky_ttl_s": "seconds a session sticks to the replica that served it (default 600)",
    "sticky_max_sessions": "sessions remembered at most (default 200000)",
    "agent_session_headers": "coding agents' session headers (Claude Code, Codex, OpenCode, X-Dynamo-Session-ID) key "
    "requests before key_headers; a sub-agent starts on its parent session's replica when it has room",
    "key_headers": "comma-separated headers carrying a session key, tried in order",
    "key_body_fields": "comma-separated body fields (dotted paths) carrying a session key",
    "prefix_chars": "characters of the first message in the prefix fingerprint (default 256)",
    "max_key_bytes": "longer keys are hashed (default 256)",
    "replica_header": "response header naming the replica (default X-Router-Replica; '' turns it off)",
    "max_attempts": "replicas tried per request before giving up (default 3)",
    "connect_timeout_s": "upstream connect time-out (default 2)",
    "first_byte_timeout_s": "time-out until the replica's first body bytes (default 60)",
    "idle_timeout_s": "longest silence inside a stream (default 60)",
    "total_timeout_s": "time-out of a whole request (default 600)",
    "client_timeout_s": "longest pause while a client sends its request body, else 408 (default 60)",
    "keepalive_timeout_s": "idle client connections close after this, as do those that have not sent a "
    "whole request's headers within it (default 75)",
    "max_body_bytes": "largest request body (default 32 MiB)",
    "tls_cert_file": "serve HTTPS with this certificate chain (PEM; with tls_key_file), read again when it changes",
    "tls_key_file": "the private key of tls_cert_file (PEM)",
    "tls_client_ca_file": "require every client to present a certificate this CA signed (mTLS; needs tls_cert_file)",
    "replica_ca_file": "verify https:// replicas against this CA alone (default: the system's CAs)",
    "replica_cert_file": "present this client certificate (PEM; with replica_key_file) to https:// replicas",
    "replica_key_file": "the private key of replica_cert_file (PEM)",
    "min_body_rate_bytes_per_s": "a request body that arrives slower than this, past its first 5 s, gets a 408 "
    "(a slow-body attack; default 1024, 0: no floor)",
    "max_header_bytes": "largest request header block (default 16 KiB)",
    "upstream_connections": "keep-alive connections per replica (default 256)",
    "inject_usage": "ask streams for usage on the client's behalf, then hide it (default on)",
    "resume_streams": "continue a stream a replica broke mid-way on another replica, in the same client stream "
    "(default on)",
    "resume_buffer_bytes": "per stream, the most of it kept to continue from; a longer stream is not resumed "
    "(default 1 MiB)",
    "front": "serve the proxied endpoints on the router's own HTTP/1.1 front (httptools) rather than aiohttp's "
    "server, which keeps every other path (default on)",
    "health_checks": "probe replicas and route around sick ones (default on)",
    "agents": "comma-separated REPLICA_ID=URL of router-agents whose GPU figures join the health score",
    "probe_interval_s": "seconds between health probes (default 2)",
    "probe_timeout_s": "time-out of one probe (default 1)",
    "remove_below": "a replica leaves routing after remove_after scores below this (default 0.5)",
    "return_above": "a removed replica returns after return_after scores above this (default 0.7)",
    "remove_after": "low scores in a row before removal (default 3)",
    "return_after": "high scores in a row before return (default 3)",
    "recovery_ramp_s": "seconds a returning or new replica's weight takes to ramp to full, in ten steps (default 30)",
    "flap_backoff": "a replica removed again while recovering needs twice the good scores to return, up to "
    "this many times return_after (default 8; 1 turns it off)",
    "score_weights": "comma-separated NAME=VALUE overrides of the health score's weights and thresholds "
    "(e.g. latency=0.5,queue_from=16; see docs/router.md)",
    "load_queue_weight": "bounded load counts in-flight requests plus this times the engine's waiting queue "
    "(default 0: in-flight only)",
    "rebalance": "move a persistently hot replica's hottest vnodes to cool replicas (default on)",
    "rebalance_threshold": "a replica is hot above (1 + this) x the mean load (default 0.5)",
    "rebalance_window_s": "seconds a replica stays hot before its vnodes move (default 30)",
    "rebalance_cooldown_s": "seconds both sides of a move rest before the next (default 60)",
    "rebalance_max_vnodes": "vnodes moved per rebalancing cycle at most (default 4)",
    "scale_from_zero_s": "seconds a request waits for a ready replica of its model where none is (a fleet scaled to "
    "zero while its autoscaler starts one), held in the overload queue, before its 503 with Retry-After; with it "
    "on, the recommended replica count falls to 0 once the fleet has been idle for rebalance_window_s and rises "
    "as a request waits (default 0: off, a 503 at once)",
    "scale_target_load": "requests in flight plus waiting per replica that the recommended replica count "
    "aims for (default 16)",
    "warmup": "replay sessions' latest prompts (prefill only) on a replica before moving them there (default on)",
    "warmup_sessions": "sessions warmed per move at most, most recent first (default 32)",
    "warmup_concurrency": "warm-up requests in flight to one replica at once (default 4)",
    "warmup_timeout_s": "seconds a move waits for its warm-up before switching anyway (default 10)",
    "prompt_store_bytes": "memory for the latest prompt of each session, kept for warm-up (default 64 MiB)",
    "drain_timeout_s": "seconds a drain that removes the replica waits for its in-flight requests (default 120)",
    "discovery": "find replicas: file:PATH (one [NAME=]URL per line, watched), dns:NAME:PORT (A/AAAA "
    "records, e.g. a headless Kubernetes service) or srv:NAME (SRV records)",
    "discovery_interval_s": "seconds between discovery lookups (default 5)",
    "state": "where routing state (membership changes, drains, vnode overrides, sessions) lives: file (default, "
    "under $XDG_STATE_HOME/kv-affinity-router; --check-config prints the path), file:DIRECTORY, "
    "redis://HOST:PORT/DB (shared by several routers), or none (the default with --demo)",
    "state_namespace": "routers sharing one Redis and one namespace share their state (default: default)",
    "workers": "proxy processes sharing the port (default 1); above 1 a control process probes and "
    "publishes the replica table to them through shared memory",
    "shm_name": "shared-memory segment name for workers and colocated router-agents (default: kvar-<pid> "
    "with --workers above 1; with one worker, set it to let router-agent --shm write GPU figures)",
    "shm_slots": "replicas the shared-memory table holds at most (default 1024)",
    "console": "serve the operator console at /console (default on; its data needs the admin token when one is set)",
    "console_interval_s": "seconds between the console's samples of the metrics (default 2)",
    "console_history_s": "seconds of history the console keeps and shows (default 900)",
    "client_keys_file": "a file of clients' keys, as SHA-256 hashes, each naming a tenant (TOML [[keys]] entries: id, "
    "tenant, sha256; [[tenants]] entries: name, priority, tokens_per_minute), read again when it changes; every "
    "API request must bring one (Authorization: Bearer or x-api-key). Empty: no keys asked",
    "budget_reserve_tokens": "what a request that names no max_tokens reserves of its tenant's tokens_per_minute for "
    "its answer, at admission; settled on its usage when it ends (default 1024)",
    "replica_api_keys": "comma-separated REPLICA_ID=KEY (or *=KEY): the key a replica's engine was started with "
    "(--api-key), sent to it as Authorization: Bearer; a client's own key is never forwarded where one is set",
    "admin_token": "bearer token of the /admin API and the console's data, and with client keys on of /metrics "
    "on the API's port (default: API off, console open)",
    "admin_host": "address the admin API, console and /metrics bind when admin_port is set (default 127.0.0.1)",
    "admin_port": "serve the admin API, console and /metrics on this port instead of the proxy's "
    "(default 0: on the proxy's port)",
    "log_requests": "one JSON log line per request (default off)",
    "prefill": "a replica that prefills for the decode replicas (vLLM with a KV connector: NixlConnector), "
    "[NAME=]URL; repeatable (default none: nothing is split)",
    "decode": "a replica that decodes what a prefill replica computed, and serves alone what is not worth "
    "splitting, [NAME=]URL; repeatable",
    "prefill_discovery": "find prefill replicas as --discovery finds the others (file:PATH, dns:NAME:PORT or "
    "srv:NAME: e.g. the SRV name of the prefill replicas' headless service), every discovery_interval_s; "
    "replicas found and gone join and leave the prefill replicas",
    "disagg_min_prompt_tokens": "with prefill replicas: a request leaving fewer tokens than this to prefill on "
    "its decode replica (its prompt less what the prefix index predicts there) is served there alone (default 512)",
    "prefill_anywhere": "with no prefill replicas (and policy ttft): any replica may prefill a request for another "
    "(vLLM's kv_both connector on every replica), chosen per request: the replica whose prefill would cost the "
    "fleet least waiting (its first token, plus the streams it would stall), where that beats prefilling on the "
    "request's own replica, which then reads the KV and decodes; a session moved off a replica still up (a drain's "
    "warm-up, a cheaper home) has its KV read from there instead of computed again (default off)",
    "disagg_introduce": "with prefill replicas: introduce each prefill replica to each decode replica with a split "
    "request of the router's own (the engines' first handshake, NIXL's: seconds), and split a client's request "
    "only across a pair that has met; a decode replica that has met none serves alone meanwhile (default on; "
    "off: any pair is split across, and the first request of each pays the handshake)",
    "demo": "start N emulated replicas in-process and route to them too; a demo saves no routing state unless "
    "--state is given",
}


# --help in the order a newcomer needs it: starting, then one group per part of the router (`demo`
# and `replicas` are the CLI's own, first of all). Each group but the first is a table of its own in
# a TOML file too (its section, first: `[health]`), where a setting may also stand at the top.
GROUPS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "", "start here",
        "where to listen, what to route to, and how",
        ("host", "port", "policy", "workers", "state", "admin_token", "admin_port", "console", "log_requests"),
    ),
    (
        "fleet", "replicas",
        "how they are found and what each serves",
        ("discovery", "discovery_interval_s", "replica_models", "replica_capacity", "agents", "replica_header"),
    ),
    (
        "disagg", "prefill/decode disaggregation",
        "replicas that prefill, replicas that decode, and what is split",
        ("prefill", "decode", "prefill_discovery", "disagg_min_prompt_tokens", "prefill_anywhere", "disagg_introduce"),
    ),
    (
        "sessions", "sessions and routing keys",
        "what keeps a conversation on the replica holding its context",
        (
            "agent_session_headers", "key_headers", "key_body_fields", "sticky_ttl_s", "sticky_max_sessions",
            "prefix_chars", "max_key_bytes",
        ),
    ),
    (
        "placement", "placement (ttft)",
        "the default policy: each request where its time to first token is predicted least",
        (
            "kv_events", "kv_event_endpoints", "kv_events_max_mib", "kv_event_followers", "tokenizer_dirs",
            "token_check_share",
            "prefix_block_bytes", "kv_capacity_tokens", "kv_tier_tokens_per_s", "prefill_tokens_per_s", "ttft_decode_s",
            "ttft_interference", "ttft_spread_tokens", "ttft_gate_c", "ttft_stay_share", "ttft_move_weight",
            "ttft_move_cooldown_s", "ttft_tie_s", "ttft_tie_share", "adapter_load_s", "ttft_kv_wait",
            "ttft_queue_gain",
        ),
    ),
    (
        "ring", "the ring and load",
        "affinity and consistent_hash, and the load caps every policy keeps",
        ("vnodes", "hash_seed", "bounded_load_c", "bounded_load_floor", "capacity_caps", "load_queue_weight"),
    ),
    (
        "tenancy", "a shared fleet",
        "who may use it, its tenants' budgets, and the replicas' own keys",
        ("client_keys_file", "budget_reserve_tokens", "replica_api_keys"),
    ),
    (
        "tls", "TLS",
        "HTTPS to clients (and their certificates) and to replicas",
        TLS_FILES,
    ),
    (
        "admission", "admission",
        "holding requests while every replica is full",
        ("max_queued", "queue_timeout_s", "ttft_target_ms", "full_waiting", "full_kv_usage"),
    ),
    (
        "health", "health",
        "probing replicas and routing around sick ones",
        (
            "health_checks", "probe_interval_s", "probe_timeout_s", "remove_below", "return_above",
            "remove_after", "return_after", "recovery_ramp_s", "flap_backoff", "score_weights",
        ),
    ),
    (
        "balance", "balance, warm-up and drains",
        "moving load off hot replicas without a session storm",
        (
            "rebalance", "rebalance_threshold", "rebalance_window_s", "rebalance_cooldown_s",
            "rebalance_max_vnodes", "scale_target_load", "scale_from_zero_s", "warmup", "warmup_sessions",
            "warmup_concurrency", "warmup_timeout_s", "prompt_store_bytes", "drain_timeout_s",
        ),
    ),
    (
        "proxying", "proxying: time-outs, limits, streams",
        "",
        (
            "max_attempts", "connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s", "total_timeout_s",
            "client_timeout_s", "keepalive_timeout_s", "max_body_bytes",
            "min_body_rate_bytes_per_s", "max_header_bytes",
            "upstream_connections", "inject_usage", "resume_streams", "resume_buffer_bytes", "front",
        ),
    ),
    (
        "processes", "state, processes, console",
        "",
        (
            "state_namespace", "shm_name", "shm_slots", "console_interval_s", "console_history_s", "admin_host",
        ),
    ),
)  # fmt: skip

# a group's TOML table: its section name and the settings it holds
SECTIONS: dict[str, tuple[str, ...]] = {section: names for section, _, _, names in GROUPS if section}
