"""Metrics are set up by one explicit call (`metrics.setup`), whatever was imported first.

Each case runs in a fresh interpreter: the choice is made once per process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )


def test_workers_metrics_add_up_when_everything_was_imported_before_setup(
    tmp_path: Path,
) -> None:
    """What `serve --workers` relies on: values observed in forked processes reach the parent's
    /metrics. The gateway's modules (and prometheus_client) are imported before `setup`, as a
    `cli.py` with every import at the top would: the order must not matter."""
    result = run(f"""
        import os
        import prometheus_client
        from oncegate import service
        from oncegate.commands import cli
        from oncegate.telemetry import metrics
        from oncegate.http import runtime, server
        from oncegate.store import checkpoints, postgres

        metrics.setup(multiprocess_dir={str(tmp_path)!r})
        metrics.KEYS_PURGED.inc(1)
        metrics.STORE_OPERATION_DURATION.labels("claim").observe(0.001)
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                metrics.KEYS_PURGED.inc(10)
                metrics.REQUESTS.labels("mail", "POST", "forwarded").inc()
                os._exit(0)
            os.waitpid(pid, 0)
        print(metrics.exposition().decode())
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "oncegate_keys_purged_total 21.0" in lines
    assert 'oncegate_requests_total{method="POST",outcome="forwarded",route="mail"} 2.0' in lines
    assert any(line.startswith("oncegate_store_operation_duration_seconds_count") for line in lines)
    assert list(tmp_path.glob("*.db")), "no value was kept in the shared directory"


def test_the_gateway_runtime_refuses_to_start_without_setup() -> None:
    result = run("""
        import asyncio
        from oncegate import settings
        from oncegate.http import runtime

        config = settings.load({"upstream": "http://127.0.0.1:9"}, {}, None)

        async def main():
            async with runtime.running(config, "postgresql://nobody@127.0.0.1:9/none"):
                pass

        asyncio.run(main())
    """)
    assert result.returncode != 0
    assert "MetricsNotSetUp" in result.stderr and "setup() was not called" in result.stderr


def test_setup_after_a_metric_was_used_is_refused() -> None:
    result = run("""
        from oncegate.telemetry import metrics

        metrics.KEYS_PURGED.inc(1)
        metrics.setup()
    """)
    assert result.returncode != 0 and "came after 1 values were used" in result.stderr


def test_without_setup_a_library_process_counts_in_memory_as_before() -> None:
    """The agent's checkpoint store times its operations with the store's timers: a script that
    uses it never calls `setup`, and must not need to."""
    result = run("""
        from oncegate.telemetry import metrics

        metrics.KEYS_PURGED.inc(3)
        print(metrics.exposition().decode())
    """)
    assert result.returncode == 0, result.stderr
    assert "oncegate_keys_purged_total 3.0" in result.stdout.splitlines()
