"""`examples/agent.py`, run as the README says, on the gateway's own embedded default."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import DemoUpstream, Process
from tests.helpers import free_port


def parse(line: str) -> tuple[str, object]:
    step, _, output = line.partition(": ")
    return step, ast.literal_eval(output)


EXAMPLE = Path(__file__).parents[2] / "examples" / "agent.py"


@pytest.fixture
def data_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="oncegate-test-example-"))
    directory.chmod(0o755)  # as root the embedded PostgreSQL runs as pgserver's user
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_the_example_agent_runs_on_the_gateways_embedded_database_and_resumes_without_repeating(
    data_dir: Path, upstream: DemoUpstream, tmp_path: Path
) -> None:
    environment = {
        **{name: value for name, value in os.environ.items() if not name.startswith("ONCEGATE")},
        "ONCEGATE_DATA_DIR": str(data_dir),
    }
    port = free_port()
    gateway = Process(
        ["serve", "--upstream", upstream.url, "--port", str(port), "--admin-port",
         str(free_port())],
        tmp_path / "gateway.log",
        env={"ONCEGATE_DATABASE_URL": "", "ONCEGATE_DATA_DIR": str(data_dir)},
    )  # fmt: skip
    run_id = f"run-{uuid.uuid4()}"
    try:
        gateway.wait_listening(port)
        outputs = []
        for _ in range(2):
            result = subprocess.run(
                [sys.executable, str(EXAMPLE), run_id],
                env={**environment, "GATEWAY_URL": f"http://127.0.0.1:{port}"},
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            outputs.append(result.stdout)
    finally:
        gateway.stop()
    lines = outputs[0].splitlines()
    assert [line.split(":", 1)[0] for line in lines] == ["step 1", "step 2", "step 3", "step 4"]
    # The second run found the finished run's checkpoint: the same outputs (key order aside, as
    # PostgreSQL's jsonb keeps them), nothing sent again.
    assert [parse(line) for line in outputs[1].splitlines()] == [parse(line) for line in lines]
    assert len(upstream.actions(f"{run_id}:step-2:email")) == 1
    assert len(upstream.actions(f"{run_id}:step-3:charge")) == 1
