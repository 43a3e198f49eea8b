"""`examples/agent.py`, run as the README says, on the gateway's own embedded default."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import DemoUpstream, GatewayProcess, Process
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


@pytest.fixture
def environment(data_dir: Path, upstream: DemoUpstream, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A gateway on its embedded default in `data_dir`, and the environment an example run from
    the README has: no ONCEGATE_* but the data directory, GATEWAY_URL naming that gateway."""
    port = free_port()
    with Process(
        ["serve", "--upstream", upstream.url, "--port", str(port), "--admin-port",
         str(free_port())],
        tmp_path / "gateway.log",
        env={"ONCEGATE_DATABASE_URL": "", "ONCEGATE_DATA_DIR": str(data_dir)},
    ) as gateway:  # fmt: skip
        gateway.wait_listening(port)
        yield {
            **{key: value for key, value in os.environ.items() if not key.startswith("ONCEGATE")},
            "ONCEGATE_DATA_DIR": str(data_dir),
            "GATEWAY_URL": f"http://127.0.0.1:{port}",
        }


def test_the_example_agent_runs_on_the_gateways_embedded_database_and_resumes_without_repeating(
    environment: dict[str, str], upstream: DemoUpstream
) -> None:
    run_id = f"run-{uuid.uuid4()}"
    outputs = []
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, str(EXAMPLE), run_id],
            env=environment, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    lines = outputs[0].splitlines()
    assert [line.split(":", 1)[0] for line in lines] == [
        "step 1", "step 2", "step 3", "step 4", "tool call", "tool call"
    ]  # fmt: skip
    # The second run found the finished run's checkpoint: the same outputs (key order aside, as
    # PostgreSQL's jsonb keeps them), nothing sent again; its tool calls, sent again with the
    # keys of their ids, were answered from the gateway's store with the same receipts.
    assert [parse(line) for line in outputs[1].splitlines()] == [parse(line) for line in lines]
    for key in (f"{run_id}:step-2:email", f"{run_id}:step-3:charge",
                f"{run_id}:call_team:email", f"{run_id}:call_manager:email"):  # fmt: skip
        assert len(upstream.actions(key)) == 1, key


LANGGRAPH_EXAMPLE = Path(__file__).parents[2] / "examples" / "langgraph_agent.py"


def test_the_langgraph_example_killed_after_its_email_sends_it_once_when_run_again(
    environment: dict[str, str], upstream: DemoUpstream
) -> None:
    thread = f"case-{uuid.uuid4()}"
    command = [sys.executable, str(LANGGRAPH_EXAMPLE), thread]
    first = subprocess.Popen(
        command, env={**environment, "PAUSE": "120"}, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None
        lines = []
        for line in first.stdout:
            lines.append(line)
            if "kill me now" in line:
                break
        assert lines[0] == "email: 201\n", lines
        os.kill(first.pid, signal.SIGKILL)  # kill -9, in the pause after the email
    finally:
        first.kill()
        first.wait(10)
        if first.stdout is not None:
            first.stdout.close()
    again = subprocess.run(
        command, env={**environment, "PAUSE": "0"}, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr
    # Resumed: the killed node ran again, its email was answered from the gateway's store.
    assert again.stdout.splitlines()[0] == "email: 201 replayed"
    assert "closed: True" in again.stdout
    emails = [a for a in upstream.actions() if a["idempotency_key"].startswith(f"{thread}:")]
    assert len(emails) == 1
    assert emails[0]["idempotency_key"].startswith(f"{thread}:send_email:")


def readme_agent() -> str:
    """The README's whole LangGraph agent, as printed there."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = readme.split("```python\n")[1:]
    [agent] = [block.split("```")[0] for block in blocks if "import Gateway, retry_on" in block]
    return agent


def test_the_readmes_langgraph_agent_runs_and_a_second_run_sends_nothing_again(
    gateway: GatewayProcess, database_url: str, upstream: DemoUpstream, tmp_path: Path
) -> None:
    thread = f"case-{uuid.uuid4()}"
    source = readme_agent()
    assert source.count('"http://127.0.0.1:8080"') == 1 and source.count('"case-81"') == 1
    program = tmp_path / "agent.py"
    program.write_text(
        f"DATABASE_URL = {database_url!r}\n"
        + source.replace('"http://127.0.0.1:8080"', repr(gateway.url)).replace(
            '"case-81"', repr(thread)
        )
    )
    printed = []
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, str(program)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        printed.append(result.stdout)
    assert printed[0] == printed[1] and "'id': 'em_" in printed[0]
    emails = [a for a in upstream.actions() if (a["idempotency_key"] or "").startswith(thread)]
    assert len(emails) == 1
    assert emails[0]["request"]["to"] == "ana@example.com"
