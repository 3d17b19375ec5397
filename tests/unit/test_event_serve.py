"""router-bench events --serve-workers, its pieces: the router's configuration it writes, and the
percentiles it reads off the router's lag histogram."""

from __future__ import annotations

import math
from pathlib import Path

from router.bench.event_serve import Scrape, bucket_percentile, config_text
from router.config import event_endpoints, kv_capacities, load


def test_the_configuration_written_is_what_an_operator_would_write(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(config_text([("r0", 5000, 5001), ("r1", 5002, 5003)], 3, 8123, 65536))
    config = load(str(path))
    assert [r.id for r in config.replicas] == ["r0", "r1"] and config.workers == 3 and config.port == 8123
    assert not config.health_checks and config.state == "none"
    assert kv_capacities(config.placement) == {"*": 65536}
    assert event_endpoints(config.placement) == {
        "r0": ("tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"),
        "r1": ("tcp://127.0.0.1:5002", "tcp://127.0.0.1:5003"),
    }


def test_a_percentile_is_the_bound_of_the_bucket_it_falls_in_between_two_reads() -> None:
    before = {0.001: 10.0, 0.01: 10.0, 0.1: 10.0, math.inf: 10.0}
    after = {0.001: 10.0 + 50, 0.01: 10.0 + 98, 0.1: 10.0 + 100, math.inf: 10.0 + 100}
    assert bucket_percentile(before, after, 50) == 0.001
    assert bucket_percentile(before, after, 98) == 0.01
    assert bucket_percentile(before, after, 99) == 0.1
    assert math.isnan(bucket_percentile(after, after, 50))  # nothing counted between them
    assert bucket_percentile({}, {0.1: 0.0, math.inf: 5.0}, 50) == math.inf


def test_what_is_read_off_the_metrics_page() -> None:
    text = (
        "# TYPE router_kv_events_believed gauge\n"
        'router_kv_events_believed{replica="r0"} 1.0\n'
        'router_kv_events_believed{replica="r1"} 0.0\n'
        "# TYPE router_kv_event_lag_seconds histogram\n"
        'router_kv_event_lag_seconds_bucket{le="0.001"} 3.0\n'
        'router_kv_event_lag_seconds_bucket{le="+Inf"} 4.0\n'
        "router_kv_event_lag_seconds_count 4.0\n"
        "router_kv_event_lag_seconds_sum 0.5\n"
    )
    got = Scrape(text)
    assert got.believed == {"r0": 1.0, "r1": 0.0}
    assert got.lag == {0.001: 3.0, math.inf: 4.0}
