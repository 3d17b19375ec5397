"""A real vLLM replica's start, as the tests and benchmarks read its log (router.bench.vllm)."""

from __future__ import annotations

from pathlib import Path

from router.bench.vllm import VllmServer

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
