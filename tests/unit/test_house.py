"""The habits that hold the house: a long module says why it is long, and the README's layout names every room."""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src" / "router"
LONG = 450  # lines: past this a module says at its top why it is one room
REASON = re.compile(r"past 450 lines\W+(\w+\W+){5,}", re.IGNORECASE)  # ... and gives a reason of some words


def _head(path: Path) -> str:
    """A module's docstring and the comments before its first statement after it."""
    text = path.read_text()
    module = ast.parse(text)
    head = ast.get_docstring(module, clean=False) or ""
    body = [n for n in module.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    first = body[0].lineno if body else len(text.splitlines()) + 1
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.start[0] >= first:
            break
        if tok.type == tokenize.COMMENT:
            head += "\n" + tok.string
    return head


def _long_modules() -> list[tuple[Path, int]]:
    modules = [*SOURCE.rglob("*.py"), *(ROOT / "loadtest").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    out = []
    for path in sorted(modules):
        lines = len(path.read_text().splitlines())
        if lines > LONG:
            out.append((path, lines))
    return out


def test_a_module_past_450_lines_says_at_its_top_why_it_is_one_room() -> None:
    silent = [f"{p.relative_to(ROOT)} ({n} lines)" for p, n in _long_modules() if not REASON.search(_head(p))]
    assert not silent, (
        "these modules are past 450 lines and their docstring (or a comment before their first "
        f"statement) does not say why, as 'It is past 450 lines because ...': {silent}"
    )


def test_the_rule_sees_a_reason_and_its_absence(tmp_path: Path) -> None:
    said = tmp_path / "said.py"
    said.write_text('"""A room.\n\nIt is past 450 lines: the protocol and its server share one state.\n"""\nx = 1\n')
    commented = tmp_path / "commented.py"
    commented.write_text(
        '"""`router-bench x`."""\n\n# It is past 450 lines as its runs and report read as one.\nimport os\n'
    )
    bare = tmp_path / "bare.py"
    bare.write_text('"""A room."""\n\nx = 1\n# It is past 450 lines because of the comment after the code.\n')
    short = tmp_path / "short.py"
    short.write_text('"""A room.\n\nIt is past 450 lines.\n"""\n')
    assert REASON.search(_head(said)) and REASON.search(_head(commented))
    assert not REASON.search(_head(bare)) and not REASON.search(_head(short))


def _layout() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Layout")
    fence = readme.index("```", start)
    return readme[fence : readme.index("```", fence + 3)]


def _named(block: str, path: Path) -> bool:
    """`path` (a module or a package) is named in the layout `block`: by its file name, its folder
    name with a slash, its stem as a word (a benchmark's without `_bench`), or a glob that matches it."""
    if path.is_dir():
        return f"{path.name}/" in block
    words = (path.name, path.stem, path.stem.removesuffix("_bench"))
    if any(re.search(rf"(?<![\w.]){re.escape(w)}(?![\w])", block) for w in words):
        return True
    return any(fnmatch.fnmatch(path.name, g) for g in re.findall(r"\w*\*[\w*]*\.py", block))


def test_the_readme_layout_names_every_top_level_module_every_package_and_every_benchmark_module() -> None:
    block = _layout()
    rooms = [p for p in SOURCE.iterdir() if p.name not in ("__init__.py", "__pycache__") and not p.name.endswith(".so")]
    rooms = [p for p in rooms if p.is_dir() or p.suffix == ".py"]
    rooms += [p for p in (SOURCE / "bench").glob("*.py") if p.name != "__init__.py"]
    missing = sorted(str(p.relative_to(SOURCE)) for p in rooms if not _named(block, p))
    assert not missing, f"README.md's layout does not name: {missing}"


def test_the_layout_rule_misses_what_is_not_named(tmp_path: Path) -> None:
    block = "src/router/prompt.py  placement/   a prompt; router-bench: ring, tokens, (fleet_*.py)"
    (tmp_path / "placement").mkdir()
    (tmp_path / "policy").mkdir()
    for name in ("prompt.py", "ring_bench.py", "tokens_bench.py", "fleet_report.py", "prompts.py", "bound.py"):
        (tmp_path / name).write_text("")
    named = {p.name for p in tmp_path.iterdir() if _named(block, p)}
    assert named == {"placement", "prompt.py", "ring_bench.py", "tokens_bench.py", "fleet_report.py"}


DOOR = ("routing", "policy", "bench")  # the routing core, the policies, and benchmarks of a policy alone


def _door_calls(path: Path) -> list[str]:
    """Calls in `path` that only the routing core may make: a policy's `pick` or `hear`, a fleet's
    `acquire` or `release` (a route's own `release` is the way in for everyone else)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, receiver = node.func.attr, ast.unparse(node.func.value)
        if name in ("pick", "hear") or (name in ("acquire", "release") and receiver.split(".")[-1] == "fleet"):
            out.append(f"{path.name}:{node.lineno} {receiver}.{name}")
    return out


def test_only_the_routing_core_picks_hears_acquires_and_releases() -> None:
    outside = [
        call
        for path in sorted(SOURCE.rglob("*.py"))
        if path.relative_to(SOURCE).parts[0] not in DOOR
        for call in _door_calls(path)
    ]
    assert not outside, f"these go around the routing core (router.routing: a Route picks, counts and hears): {outside}"


def test_the_door_rule_sees_a_call_around_the_core(tmp_path: Path) -> None:
    around = tmp_path / "around.py"
    around.write_text("policy.pick(key, None, ())\nself.pool.fleet.acquire(r)\nroute.release(r)\nlock.acquire()\n")
    assert [c.split(" ")[1] for c in _door_calls(around)] == [
        "policy.pick",
        "self.pool.fleet.acquire",
    ]


# the modules that assemble the router from its whole config and hand each room its group of settings
# (router.config.groups); the factories that read a config for what they make (a policy's groups, the
# keys' settings), the server around the front, and the benchmarks
ASSEMBLY = (
    "config/*",
    "node.py",
    "pools.py",
    "proxy/cli.py",
    "proxy/workers.py",
    "proxy/followers.py",  # a process that follows a shard of the KV events: its fleet, policy and feed, built
    "proxy/front_server.py",
    "policy/__init__.py",
    "policy/base.py",
    "policy/ttft.py",
    "routing/request.py",
    "bench/*",
)


def _takes_whole_config(path: Path) -> bool:
    return any(
        isinstance(node, ast.Name) and node.id == "RouterConfig" for node in ast.walk(ast.parse(path.read_text()))
    )


def test_each_room_receives_its_group_of_settings_not_the_whole_config() -> None:
    whole = [
        str(rel)
        for path in sorted(SOURCE.rglob("*.py"))
        if not any(fnmatch.fnmatch(str(rel := path.relative_to(SOURCE)), pattern) for pattern in ASSEMBLY)
        and _takes_whole_config(path)
    ]
    assert not whole, f"these take the whole RouterConfig; give them their group (config.<section>): {whole}"


def test_the_settings_rule_sees_the_whole_config_named(tmp_path: Path) -> None:
    (tmp_path / "whole.py").write_text("def f(config: RouterConfig) -> int:\n    return config.port\n")
    (tmp_path / "group.py").write_text("def f(config: ProxySettings) -> int:\n    return config.max_attempts\n")
    assert _takes_whole_config(tmp_path / "whole.py") and not _takes_whole_config(tmp_path / "group.py")


def test_no_two_test_modules_share_a_name() -> None:
    # the tests are not packages, so pytest imports each by its file's name: two test_x.py in two
    # folders collect as one module, and the whole run stops at collection (it passes when each
    # folder runs alone, as a contributor often runs them)
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, f"test modules that share a name (rename one): {shared}"
