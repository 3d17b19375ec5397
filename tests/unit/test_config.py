"""Router configuration: precedence, validation, one clear line per bad setting."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from router.config import (
    AUTO_QUEUED,
    ENV_NAMES,
    FIELDS,
    NOT_SETTINGS,
    ConfigError,
    ReplicaSpec,
    RouterConfig,
    load,
    parse_replica,
    replica_capacities,
    score_weights,
)
from router.config.groups import GROUP_CLASSES
from router.config.meanings import GROUPS, HELP, SECTIONS
from router.health.score import ScoreWeights
from router.node import Node
from router.proxy.cli import build_parser, cli_values


def test_defaults_file_env_cli_in_that_order(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text('port = 9000\npolicy = "round_robin"\nreplicas = ["http://10.0.0.5:8000"]\nvnodes = 64\n')
    cfg = load(str(toml), {"ROUTER_PORT": "9100", "ROUTER_VNODES": "32"}, {"port": 9200, "policy": None})
    assert cfg.port == 9200  # CLI beats env beats file
    assert cfg.vnodes == 32  # env beats file
    assert cfg.policy == "round_robin"  # file beats default; a CLI None means "not given"
    assert cfg.replicas == (ReplicaSpec("10.0.0.5:8000", "http://10.0.0.5:8000"),)
    assert cfg.host == "127.0.0.1" and cfg.bounded_load_c == 1.25


def test_lists_and_booleans_from_the_environment() -> None:
    cfg = load(
        None,
        {
            "ROUTER_REPLICAS": "a=http://h1:1, http://h2:2/",
            "ROUTER_LOG_REQUESTS": "yes",
            "ROUTER_KEY_HEADERS": "x-a, x-b",
        },
        {},
    )
    assert cfg.replicas == (ReplicaSpec("a", "http://h1:1"), ReplicaSpec("h2:2", "http://h2:2"))
    assert cfg.log_requests is True and cfg.key_headers == ("x-a", "x-b")


@pytest.mark.parametrize(
    ("env", "cli", "setting", "source"),
    [
        ({}, {"replicas": ["http://a:1"], "port": 70000}, "port", "--port"),
        ({"ROUTER_POLICY": "fastest"}, {"replicas": ["http://a:1"]}, "policy", "ROUTER_POLICY"),
        ({}, {"replicas": ["ftp://a:1"]}, "replicas", "--replica"),
        ({}, {}, "replicas", "default"),
        ({}, {"replicas": ["http://a:1", "http://a:1"]}, "replicas", "--replica"),
        ({}, {"replicas": ["a=http://h:1", "b=http://h:1"]}, "replicas", "--replica"),
        ({"ROUTER_REPLICA_HEADER": "X Bad"}, {"replicas": ["http://a:1"]}, "replica_header", "ROUTER_REPLICA_HEADER"),
        ({"ROUTER_BOUNDED_LOAD_C": "0.5"}, {"replicas": ["http://a:1"]}, "bounded_load_c", "ROUTER_BOUNDED_LOAD_C"),
        ({"ROUTER_VNODES": "many"}, {"replicas": ["http://a:1"]}, "vnodes", "ROUTER_VNODES"),
        ({"ROUTER_LOG_REQUESTS": "maybe"}, {"replicas": ["http://a:1"]}, "log_requests", "ROUTER_LOG_REQUESTS"),
        ({"ROUTER_IDLE_TIMEOUT_S": "nan"}, {"replicas": ["http://a:1"]}, "idle_timeout_s", "ROUTER_IDLE_TIMEOUT_S"),
        ({"ROUTER_AGENTS": "b=http://x:1"}, {"replicas": ["a=http://a:1"]}, "agents", "ROUTER_AGENTS"),
        ({}, {"replicas": ["http://a:1"], "workers": "0"}, "workers", "--workers"),
        (
            {"ROUTER_KV_EVENT_FOLLOWERS": "0"},
            {"replicas": ["http://a:1"]},
            "kv_event_followers",
            "ROUTER_KV_EVENT_FOLLOWERS",
        ),
        ({}, {"replicas": ["http://a:1"], "kv_event_followers": "65"}, "kv_event_followers", "--kv-event-followers"),
        ({"ROUTER_STICKY_TTL_S": "1e10"}, {"replicas": ["http://a:1"]}, "sticky_ttl_s", "ROUTER_STICKY_TTL_S"),
        ({}, {"replicas": ["http://a:1"], "score_weights": "speed=1"}, "score_weights", "--score-weights"),
        ({"ROUTER_SCORE_WEIGHTS": "queue=2"}, {"replicas": ["http://a:1"]}, "score_weights", "ROUTER_SCORE_WEIGHTS"),
        ({}, {"replicas": ["http://a:1"], "score_weights": "queue_from=99"}, "score_weights", "--score-weights"),
        ({"ROUTER_SHM_NAME": "../etc"}, {"replicas": ["http://a:1"]}, "shm_name", "ROUTER_SHM_NAME"),
        ({}, {"replicas": ["http://a:1", "http://b:1"], "shm_slots": "1"}, "shm_slots", "--shm-slots"),
        ({}, {"replicas": ["x" * 65 + "=http://a:1"]}, "replicas", "--replica"),
    ],
)
def test_bad_settings_name_the_setting_and_its_source(env: dict, cli: dict, setting: str, source: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(None, env, cli)
    assert info.value.setting == setting
    assert f"invalid setting '{setting}' (from {source})" in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("port = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(str(bad), {}, {})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('replicas = ["http://a:1"]\nprot = 1\n')
    with pytest.raises(ConfigError, match=rf"unknown setting prot \(from {unknown}\): did you mean port\?"):
        load(str(unknown), {}, {})
    with pytest.raises(ConfigError, match="invalid setting 'config'"):
        load(str(tmp_path / "missing.toml"), {}, {})
    wrong_type = tmp_path / "wrong.toml"
    wrong_type.write_text('replicas = ["http://a:1"]\nhost = ["x"]\n')
    with pytest.raises(ConfigError, match=r"invalid setting 'host'.*expected a string"):
        load(str(wrong_type), {}, {})


def test_replica_urls() -> None:
    assert parse_replica("http://10.0.0.5:8000/") == ReplicaSpec("10.0.0.5:8000", "http://10.0.0.5:8000")
    assert parse_replica("gpu-3=https://h/v") == ReplicaSpec("gpu-3", "https://h/v")
    assert parse_replica("https://h") == ReplicaSpec("h:443", "https://h")
    for bad in ("10.0.0.5:8000", "http://", "http://h:notaport"):
        with pytest.raises(ValueError):
            parse_replica(bad)


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "0", "--replica", "http://a:1"],
        [],
        ["--replica", "nope"],
        ["--policy", "x", "--replica", "http://a:1"],
    ],
)
def test_router_serve_exits_2_with_one_line(args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "router.proxy.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("router-serve: invalid setting '") and proc.stderr.count("\n") == 1


def test_unknown_names_are_named_once_each_with_the_closest_settings(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text('replicas = ["http://a:1"]\nsticky_ttl = 5\nzzz = 1\n')
    env = {
        "ROUTER_STICKY_TLL_S": "5",  # a typo
        "ROUTER_WORKER": "2",  # a letter short
        "ROUTER_ROUTER_PORT": "1",  # the prefix twice
        "ROUTER_NO_EXTENSIONS": "1",  # not a setting, but the pure-Python opt-out
        "ROUTER_SERVICE_HOST": "10.0.0.1",  # Kubernetes' service links for a Service named "router"
        "ROUTER_PORT_8080_TCP_ADDR": "10.0.0.1",
        "ROUTER_REDIS_SERVICE_HOST": "10.0.0.2",  # ... and for one named "router-redis"
        "ROUTER_REDIS_SERVICE_PORT_REDIS": "6379",
        "ROUTER_REDIS_PORT": "tcp://10.0.0.2:6379",
        "ROUTER_REDIS_PORT_6379_TCP_PROTO": "tcp",
        "OTHER_STICKY_TLL_S": "5",  # not ours
    }
    with pytest.raises(ConfigError) as info:
        load(str(toml), env, {})
    assert str(info.value).splitlines() == [
        f"unknown setting sticky_ttl (from {toml}): did you mean sticky_ttl_s?",
        f"unknown setting zzz (from {toml}): router-serve --help lists the settings",
        "unknown setting ROUTER_ROUTER_PORT (from the environment): did you mean ROUTER_PORT?",
        "unknown setting ROUTER_STICKY_TLL_S (from the environment): did you mean ROUTER_STICKY_TTL_S?",
        "unknown setting ROUTER_WORKER (from the environment): did you mean ROUTER_WORKERS?",
    ]
    with pytest.raises(ConfigError, match=r"Kubernetes' service link .* enableServiceLinks: false"):
        load(None, {"ROUTER_PORT": "tcp://10.0.0.1:8080"}, {"replicas": ["http://a:1"]})
    with pytest.raises(ConfigError, match=r"service link for a Service named 'router-admin'.* --admin-port"):
        load(None, {"ROUTER_ADMIN_PORT": "tcp://10.0.0.3:80"}, {"replicas": ["http://a:1"]})


def test_a_file_may_hold_each_group_in_its_own_table(tmp_path: Path) -> None:
    flat = tmp_path / "flat.toml"
    flat.write_text('replicas = ["http://a:1"]\nprobe_interval_s = 0.5\nmax_queued = 40\nvnodes = 64\n')
    grouped = tmp_path / "grouped.toml"
    grouped.write_text(
        'replicas = ["http://a:1"]\nvnodes = 64\n[health]\nprobe_interval_s = 0.5\n[admission]\nmax_queued = 40\n'
    )
    assert load(str(grouped), {}, {}) == load(str(flat), {}, {})
    assert load(str(grouped), {}, {}).probe_interval_s == 0.5
    assert load(str(grouped), {"ROUTER_MAX_QUEUED": "7"}, {}).max_queued == 7  # the environment still wins
    # a bad value in a table names the table
    grouped.write_text('replicas = ["http://a:1"]\n[health]\nprobe_interval_s = -1\n')
    with pytest.raises(ConfigError, match=re.escape(f"invalid setting 'probe_interval_s' (from {grouped} [health])")):
        load(str(grouped), {}, {})


def test_a_setting_in_another_group_s_table_is_sent_where_it_belongs(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text('replicas = ["http://a:1"]\n[health]\nmax_queued = 4\nport = 1\nprobe_intervall_s = 1\nzzz = 1\n')
    with pytest.raises(ConfigError) as info:
        load(str(toml), {}, {})
    assert str(info.value).splitlines() == [
        f"setting max_queued is not one of [health] (from {toml}): it belongs in [admission], or at the top",
        f"setting port is not one of [health] (from {toml}): it stands at the top",
        f"unknown setting probe_intervall_s in [health] (from {toml}): did you mean probe_interval_s?",
        f"unknown setting zzz in [health] (from {toml}): router-serve --help lists [health]'s settings",
    ]
    toml.write_text('replicas = ["http://a:1"]\nprobe_interval_s = 1\n[health]\nprobe_interval_s = 2\n')
    with pytest.raises(ConfigError, match=r"'probe_interval_s' .*is set twice: at the top and in \[health\]"):
        load(str(toml), {}, {})


def test_each_group_s_table_is_named_apart_from_every_setting() -> None:
    sections = [section for section, _, _, _ in GROUPS if section]
    assert len(sections) == len(set(sections)) == len(GROUPS) - 1  # every group but "start here"
    assert not set(sections) & set(FIELDS)  # `[health]` can never be read as a setting's value
    assert dict(SECTIONS) == {section: names for section, _, _, names in GROUPS if section}


def test_every_router_variable_the_code_reads_is_a_setting_or_known_not_to_be() -> None:
    # a new ROUTER_* variable that is not a setting must join NOT_SETTINGS, or router-serve refuses it
    source = Path(__file__).parents[2] / "src" / "router"  # the repository's, installed or not
    read = {m for f in source.rglob("*.py") for m in re.findall(r"[\"'](ROUTER_[A-Z0-9_]+)[\"']", f.read_text())}
    assert read and all(name in ENV_NAMES or name in NOT_SETTINGS for name in read), read - set(ENV_NAMES)
    load(None, dict.fromkeys(NOT_SETTINGS, "1"), {"replicas": ["http://a:1"]})


def test_check_config_names_every_mistake_and_where_state_is_kept(tmp_path: Path) -> None:
    def serve(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "router.proxy.cli", "--check-config", *args],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin", "XDG_STATE_HOME": str(tmp_path), **env},
        )

    typo = serve("--replica", "http://a:1", ROUTER_STICKY_TLL_S="5", ROUTER_POLICI="affinity")
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr.splitlines() == [
        "router-serve: unknown setting ROUTER_POLICI (from the environment): did you mean ROUTER_POLICY?",
        "router-serve: unknown setting ROUTER_STICKY_TLL_S (from the environment): did you mean ROUTER_STICKY_TTL_S?",
    ]
    flag = serve("--replica", "http://a:1", "--stiky-ttl-s", "5")
    assert flag.returncode == 2 and "--stiky-ttl-s: did you mean --sticky-ttl-s?" in flag.stderr
    saved = serve("--replica", "http://a:1", "--port", "9123")
    assert saved.returncode == 0, saved.stderr
    assert f"routing state saved to {tmp_path}/kv-affinity-router/routing-state-127.0.0.1-9123.json" in saved.stdout
    demo = serve("--demo", "2")  # a demo starts clean ...
    assert demo.returncode == 0 and "routing state not saved (a demo's default" in demo.stdout
    kept = serve("--demo", "2", "--state", f"file:{tmp_path}")  # ... unless asked
    assert kept.returncode == 0 and f"routing state saved to {tmp_path}/routing-state-" in kept.stdout
    shared = serve("--demo", "2", ROUTER_STATE="unix:///run/redis.sock")
    assert shared.returncode == 0 and "routing state shared through unix:///run/redis.sock" in shared.stdout


def test_help_puts_the_everyday_options_first_and_every_setting_in_one_group() -> None:
    grouped = [name for _, _, _, names in GROUPS for name in names]
    assert sorted(grouped) == sorted(set(FIELDS) - {"replicas", "demo"})  # once each
    text = build_parser().format_help()
    groups = text[text.index("start here:") :]
    assert groups.index("--demo N") < groups.index("--replica [NAME=]URL") < groups.index("--check-config")
    assert groups.index("--check-config") < groups.index("--ttft-gate-c") < groups.index("--max-queued")
    assert len(text.splitlines()[0]) < 130  # usage is one line, not a page of every flag


def test_every_setting_has_a_flag() -> None:
    args = build_parser().parse_args(
        [
            "--replica",
            "http://a:1",
            "--sticky-max-sessions",
            "7",
            "--no-inject-usage",
            "--key-body-fields",
            "user",
            "--log-requests",
        ]
    )
    cfg = load(None, {}, cli_values(args))
    assert cfg.sticky_max_sessions == 7 and cfg.inject_usage is False and cfg.key_body_fields == ("user",)
    assert cfg.log_requests is True
    assert set(cli_values(args)) == set(FIELDS)


def test_score_weights_override_the_defaults() -> None:
    cfg = load(
        None, {"ROUTER_SCORE_WEIGHTS": "latency=0.5, queue_from=16"}, {"replicas": ["http://a:1"], "state": "none"}
    )
    weights = score_weights(cfg.health)
    assert (weights.latency, weights.queue_from, weights.queue) == (0.5, 16.0, ScoreWeights().queue)
    assert Node(cfg).monitor.weights == weights  # the control loop scores with them
    queued = load(None, {"ROUTER_LOAD_QUEUE_WEIGHT": "2"}, {"replicas": ["http://a:1"], "state": "none"})
    assert Node(queued).monitor.queue_weight == 2.0  # probes add 2 x waiting to the load cap's count


def test_replica_capacity_entries() -> None:
    cfg = load(None, {"ROUTER_REPLICA_CAPACITY": "gpu-1=4, *=256"}, {"replicas": ["gpu-1=http://h:1"]})
    assert replica_capacities(cfg.fleet) == {"gpu-1": 4, "*": 256}
    for bad in ("gpu-1", "gpu-1=0", "=4", "gpu-1=four", "gpu-1=2.5", "a=1,a=2"):
        with pytest.raises(ConfigError, match=r"invalid setting 'replica_capacity' \(from ROUTER_REPLICA_CAPACITY\)"):
            load(None, {"ROUTER_REPLICA_CAPACITY": bad}, {"replicas": ["gpu-1=http://h:1"]})


def test_an_admin_token_from_a_file_loses_its_newline() -> None:
    cfg = load(None, {"ROUTER_ADMIN_TOKEN": "0123abcd0123abcd\n"}, {"replicas": ["http://h:1"]})
    assert cfg.admin_token == "0123abcd0123abcd"


def test_a_short_admin_token_is_refused_with_how_to_make_one() -> None:
    with pytest.raises(ConfigError, match=r"admin_token.*at least 16 bytes.*openssl rand -hex 32"):
        load(None, {"ROUTER_ADMIN_TOKEN": "t"}, {"replicas": ["http://h:1"]})
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        load(None, {}, {"replicas": ["http://h:1"], "admin_token": "0123456789abcde"})  # 15
    assert load(None, {}, {"replicas": ["http://h:1"], "admin_token": "0123456789abcdef"}).admin_token


def _default_words(value: object, name: str = "") -> set[str]:
    """The ways the help and the docs may write a setting's default."""
    if name == "max_queued" and value == AUTO_QUEUED:
        return {"auto"}
    if isinstance(value, bool):
        return {"true", "on"} if value else {"false", "off"}
    if isinstance(value, tuple):
        return {", ".join(map(str, value)), "—"} if value else {"—", "none"}
    if isinstance(value, int | float):
        words = {f"{value:g}", str(value)}
        for unit, size in (("KiB", 1 << 10), ("MiB", 1 << 20)):
            if value >= size and value % size == 0:
                words.add(f"{value // size:g} {unit}")
        return words
    return {str(value), "empty", "—"} if value == "" else {str(value)}


def test_each_settings_default_is_written_alike_in_the_dataclass_the_help_and_the_docs() -> None:
    # three places state a default: a drift between them is a lie in one
    docs = (Path(__file__).parents[2] / "docs" / "router.md").read_text()
    table: dict[str, str] = {}
    for line in docs.splitlines():
        row = re.match(r"\| (`[a-z_0-9]+`(?:, `[a-z_0-9]+`)*) \| ([^|]*) \|", line)
        if row:
            names = re.findall(r"`([a-z_0-9]+)`", row[1])
            defaults = [d.strip() for d in row[2].split(",")] if len(names) > 1 else [row[2].strip()]
            table.update(zip(names, defaults, strict=len(defaults) == len(names)))
    for name, field in FIELDS.items():
        default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        words = _default_words(default, name)
        assert name in table, f"{name} has no row in docs/router.md's settings table"
        written = table[name].strip("`").split("`")[0].strip()
        assert written in words, (name, default, table[name])
        said = re.search(r"\(default:? ([^);:,]*)", HELP.get(name, ""))
        value = said[1].strip() if said else ""
        if value and len(value.split()) <= 2 and value.split()[0] not in ("as", "API"):  # a value, not words
            assert value in words, (name, default, value)


def test_prefill_anywhere_lends_the_route_s_own_replicas_and_wants_ttft_and_no_prefill_replicas() -> None:
    cfg = load(None, {"ROUTER_PREFILL_ANYWHERE": "true"}, {"replicas": ["http://a:1", "http://a:2"], "state": "none"})
    node = Node(cfg)
    assert node.lending is not None and node.lending.fleet is node.fleet and node.lending.policy is node.policy
    assert len(node.pools) == 1 and node.pairs is not None and node.pairs.prefill is node.fleet  # one fleet, shown once
    assert not Node(load(None, {}, {"replicas": ["http://a:1"], "state": "none"})).lending
    with pytest.raises(ConfigError, match=r"prefill_anywhere.*without prefill replicas"):
        load(None, {}, {"prefill_anywhere": True, "prefill": ["http://p:1"], "decode": ["http://d:1"], "state": "none"})
    with pytest.raises(ConfigError, match=r"prefill_anywhere.*needs policy ttft"):
        load(None, {}, {"prefill_anywhere": True, "policy": "affinity", "replicas": ["http://a:1"], "state": "none"})


def test_prefill_and_decode_replicas_take_their_roles_and_decode_ones_are_routed_to() -> None:
    args = build_parser().parse_args(
        [
            "--prefill",
            "p0=http://a:1",
            "--prefill",
            "http://a:2",
            "--decode",
            "d0=http://b:1",
            "--replica",
            "http://c:1",
        ]
    )
    cfg = load(None, {"ROUTER_STATE": "none"}, cli_values(args))
    assert [(r.id, r.role) for r in cfg.replicas] == [("c:1", "both"), ("d0", "decode")]
    assert [(r.id, r.role) for r in cfg.prefill] == [("p0", "prefill"), ("a:2", "prefill")]
    node = Node(cfg)
    assert [r.role for r in node.fleet.replicas] == ["both", "decode"] and len(node.pools[1].fleet.replicas) == 2
    with pytest.raises(ConfigError, match="need replicas to decode"):
        load(None, {}, {"prefill": ["http://a:1"], "state": "none"})
    with pytest.raises(ConfigError, match="appears twice"):
        load(None, {}, {"prefill": ["x=http://a:1"], "decode": ["x=http://b:1"], "state": "none"})
    with pytest.raises(ConfigError, match="listed twice"):
        load(None, {}, {"prefill": ["http://a:1"], "decode": ["d=http://a:1"], "state": "none"})
    filed = load(None, {"ROUTER_DECODE": "http://b:1,http://b:2", "ROUTER_PREFILL": "http://a:1"}, {"state": "none"})
    assert [r.role for r in filed.replicas] == ["decode", "decode"] and filed.prefill[0].url == "http://a:1"
    # prefill replicas found by discovery: a source of the same kinds, checked as discovery's
    found = load(None, {"ROUTER_PREFILL_DISCOVERY": "srv:_http._tcp.prefill"}, {"decode": ["http://b:1"]})
    assert found.prefill_discovery == "srv:_http._tcp.prefill" and Node(found).pool("prefill") is not None
    with pytest.raises(ConfigError, match=r"prefill_discovery.*unknown discovery kind"):
        load(None, {}, {"prefill_discovery": "consul:x", "decode": ["http://b:1"], "state": "none"})
    with pytest.raises(ConfigError, match="need replicas to decode"):
        load(None, {}, {"prefill_discovery": "file:/x", "state": "none"})


def test_each_group_holds_its_table_s_settings_with_the_config_s_types_and_no_default_of_its_own() -> None:
    assert [g.section for g in GROUP_CLASSES] == list(SECTIONS)
    types = {name: f.type for name, f in FIELDS.items()}
    for group in GROUP_CLASSES:
        fields = dataclasses.fields(group)
        assert [f.name for f in fields] == list(SECTIONS[group.section]), group.section
        assert all(f.type == types[f.name] for f in fields), group.section
        # a default is written once, in RouterConfig
        assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)


def test_a_config_hands_each_room_its_group_as_set() -> None:
    cfg = RouterConfig(rebalance=False, max_attempts=5, vnodes=64, replica_api_keys=("*=sk-secret",))
    assert cfg.balance.rebalance is False and cfg.proxying.max_attempts == 5 and cfg.ring.vnodes == 64
    assert cfg.placement.prefix_block_bytes == RouterConfig.prefix_block_bytes  # the default, from the config
    assert cfg.tenancy.replica_api_keys == ("*=sk-secret",) and "sk-secret" not in repr(cfg.tenancy)
    assert cfg.ring is cfg.ring  # made once
    # a config changed by replace hands the new values on, not the old groups
    moved = dataclasses.replace(cfg, vnodes=32)
    assert moved.ring.vnodes == 32 and cfg.ring.vnodes == 64
