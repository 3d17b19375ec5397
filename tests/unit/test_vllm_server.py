"""A real vLLM replica's start, as the tests and benchmarks read its log (router.bench.vllm)."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.bench.vllm import VllmReplicas, VllmServer

LOG = """\
(APIServer pid=3703) INFO 12-05 11:04:27 [model.py:2152] Using max model len 2016
(EngineCore pid=2696) ERROR 12-05 11:00:53 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=2696) ERROR 12-05 11:00:53 [core.py:1510]   File "/venv/vllm/v1/engine/core.py", line 1030, in _check
(EngineCore pid=2696) ERROR 12-05 11:00:53 [core.py:1510]     raise ValueError(
(EngineCore pid=2696) ERROR 12-05 11:00:53 [core.py:1510] ValueError: To serve at least one request ...
(Worker pid=2711) INFO 12-05 11:00:53 [multiproc_executor.py:843] Parent process exited, terminating worker queues
"""


def test_a_failed_start_is_said_by_the_exception_that_stopped_it_not_the_logs_last_line(tmp_path: Path) -> None:
    server = VllmServer(tmp_path, 1, log=tmp_path / "v.log")
    assert server._error() == ""  # no log yet
    server.log.write_text(LOG.split("(EngineCore")[0])  # type: ignore[union-attr]
    assert server._error() == ""  # no traceback
    server.log.write_text(LOG)  # type: ignore[union-attr]
    assert server._error() == ": ValueError: To serve at least one request ..."
    assert server._tail(1).endswith("Parent process exited, terminating worker queues")


async def test_a_fleet_that_fails_to_start_is_started_once_more_and_no_more(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = VllmReplicas(kv_blocks=64, max_num_seqs=2, max_model_len=2016)
    starts: list[int] = []
    failing = [1]  # how many starts fail from now

    async def start(replicas: int) -> None:
        starts.append(replicas)
        if failing[0] > 0:
            failing[0] -= 1
            raise RuntimeError("the vLLM fleet did not start: vLLM on port 1 failed to start: OSError: in use")

    async def cold() -> None:
        return None

    monkeypatch.setattr(fleet, "_start", start)
    monkeypatch.setattr(fleet, "_cold", cold)
    await fleet.ready(2)  # the first start fails, the second passes
    assert starts == [2, 2] and "starting the vLLM fleet once more" in capsys.readouterr().err
    starts.clear()
    failing[0] = 2  # both fail: the second failure is the error
    with pytest.raises(RuntimeError, match="OSError: in use"):
        await fleet.ready(2)
    assert starts == [2, 2]
