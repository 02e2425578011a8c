"""A local Ray cluster for the Ray integration's tests (tests/test_ray.py, tests/gpu/), and a
free localhost port for Ray Serve. Imports Ray only when a cluster is started."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def local_cluster(**init_args: Any) -> Iterator[None]:
    """``ray.init(**init_args)`` without the dashboard, driver logs or usage reports (none
    leave the machine); Serve and Ray shut down afterwards."""
    import ray
    from ray import serve

    saved = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="warning", **init_args)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
        else:
            os.environ["RAY_USAGE_STATS_ENABLED"] = saved


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
