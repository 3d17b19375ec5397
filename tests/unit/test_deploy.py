"""deploy/: the Grafana dashboard and the Prometheus scrape example stay true to the metric table."""

from __future__ import annotations

import json
import re
from pathlib import Path

from router.metrics import TABLE

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def exprs(dashboard: dict) -> list[str]:  # type: ignore[type-arg]
    found = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return found + [a["expr"] for a in dashboard["annotations"]["list"]]


def test_every_dashboard_query_names_a_metric_the_router_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "kv-affinity-router.json").read_text())
    names = set()
    for expr in exprs(dashboard):
        assert expr.count("(") == expr.count(")"), expr
        for name in re.findall(r"\brouter_[a-z0-9_]+", expr):
            for suffix in SUFFIXES:
                if name.endswith(suffix) and name[: -len(suffix)] in TABLE:
                    name = name[: -len(suffix)]
            assert name in TABLE, f"{name} (in {expr}) is not in router.metrics.TABLE"
            names.add(name)
    # the console's panels are all there
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Replica load (in flight)", "KV hit rate", "Jump rate", "Replicas", "Replica state"} <= titles
    assert {"router_inflight", "router_cached_tokens", "router_prompt_tokens", "router_session_jumps"} <= names
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    # several models: requests and 429s by the model label
    assert {"router_requests_total", "router_shed_total"} <= {
        name for expr in exprs(dashboard) if "by (model)" in expr for name in re.findall(r"\brouter_[a-z_]+", expr)
    }


def test_the_scrape_example_points_at_metrics() -> None:
    text = (DEPLOY / "prometheus" / "scrape.yml").read_text()
    assert re.search(r"^\s+metrics_path: /metrics$", text, re.M)
    assert re.search(r"^\s+- job_name: kv-affinity-router$", text, re.M)
    assert "\t" not in text  # YAML takes no tabs
