"""The container and dashboard files, checked without a Docker engine.

- `docker-compose.yml` validates against the Compose Specification's JSON schema and starts
  things in the right order; the files it mounts exist and say what the services expect.
- The `Dockerfile` has the shape the issue asks for, and its install steps, replayed in a fresh
  virtual environment, give a working `oncegate` with its migrations.
- Every PromQL expression of the Grafana dashboard names real metrics and, evaluated by a real
  Prometheus that scrapes a real gateway after scripted traffic, returns data.

`compose-spec.json` beside this file is data, vendored unchanged from the PyPI package
check-jsonschema 0.39.0 (`check_jsonschema/builtin_schemas/vendor/compose-spec.json`), which
copies it from the compose-spec project (`schema/compose-spec.json`); its licence, Apache-2.0, is
`LICENSE.compose-spec` beside it. To update it: `pip download --no-deps check-jsonschema`, copy
the file out of the wheel, and change `COMPOSE_SCHEMA_SHA256` below.

The Prometheus checks need the `prometheus` and `promtool` binaries (Debian: `apt-get install -y
prometheus`; `make test` installs them where it can, as root on Debian). Where they cannot be had
(a normal user, macOS) those tests are skipped and say why; in CI (`CI` set, root on Debian, where
`.ci/run` installs them) a missing one fails the run instead, so CI always runs them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import uuid
import venv
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from oncegate import settings
from oncegate.telemetry import metrics
from tests.e2e.conftest import STARTUP_TIMEOUT, DemoUpstream, Process
from tests.helpers import free_port, total

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DASHBOARD = ROOT / "deploy" / "grafana" / "oncegate.json"
GRAFANA_PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERT_RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_RULES_TEST = HERE / "alerts_test.yml"
GATEWAY_CONFIG = ROOT / "deploy" / "oncegate.yaml"

COMPOSE_SCHEMA = HERE / "compose-spec.json"
COMPOSE_SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"

INSTALL_PROMETHEUS = "apt-get install -y --no-install-recommends prometheus"

# The metrics of contract section 7: the dashboard shows every one of them.
CONTRACT_METRICS = {
    "oncegate_requests_total",
    "oncegate_duplicates_blocked_total",
    "oncegate_upstream_request_duration_seconds",
    "oncegate_request_duration_seconds",
    "oncegate_store_operation_duration_seconds",
    "oncegate_inflight_requests",
    "oncegate_keys_purged_total",
    "oncegate_keys",
}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = load_yaml(COMPOSE_FILE)
    return document


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


# --- docker-compose.yml ----------------------------------------------------------------------


def test_vendored_compose_schema_is_the_published_one() -> None:
    digest = hashlib.sha256(COMPOSE_SCHEMA.read_bytes()).hexdigest()
    assert digest == COMPOSE_SCHEMA_SHA256, "compose-spec.json was changed after vendoring"


def test_compose_file_follows_the_compose_specification(compose: dict[str, Any]) -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    problems = [
        f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in validator.iter_errors(compose)
    ]
    assert not problems, "docker-compose.yml breaks the Compose schema:\n" + "\n".join(problems)


def test_compose_schema_check_catches_mistakes(compose: dict[str, Any]) -> None:
    """The validation above can fail: a typo in a service key is refused."""
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    broken = json.loads(json.dumps(compose))
    broken["services"]["gateway"]["depends_onn"] = broken["services"]["gateway"].pop("depends_on")
    assert not jsonschema.validators.validator_for(schema)(schema).is_valid(broken)


def test_compose_starts_in_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) >= {
        "postgres",
        "migrate",
        "gateway",
        "demo-upstream",
        "prometheus",
        "grafana",
    }
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert (
        services["gateway"]["depends_on"]["migrate"]["condition"]
        == "service_completed_successfully"
    )
    assert services["migrate"]["command"] == ["migrate"]
    assert services["migrate"].get("restart", "no") == "no", "a one-shot job is not restarted"


def test_compose_healthchecks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    postgres_check = services["postgres"]["healthcheck"]["test"]
    assert "pg_isready" in " ".join(postgres_check)
    # The gateway's check is the image's HEALTHCHECK unless compose gives its own.
    gateway_check = services["gateway"].get("healthcheck")
    if gateway_check is None:
        assert dockerfile_healthcheck(), "the gateway has no healthcheck, in compose or image"
    else:
        assert not gateway_check.get("disable")
        assert "/healthz" in " ".join(gateway_check["test"]) or "/readyz" in " ".join(
            gateway_check["test"]
        )
    # demo-upstream runs the same image, whose check probes the gateway's admin port: it needs
    # its own, or it would report unhealthy forever (and the gateway waits for it).
    assert "9000" in " ".join(services["demo-upstream"]["healthcheck"]["test"])
    assert services["gateway"]["depends_on"]["demo-upstream"]["condition"] == "service_healthy"


def test_compose_oncegate_services_share_the_image_built_once(compose: dict[str, Any]) -> None:
    services = compose["services"]
    images = {services[name]["image"] for name in ("migrate", "gateway", "demo-upstream")}
    assert len(images) == 1
    builders = [name for name, service in services.items() if "build" in service]
    assert builders == ["migrate"], "one service builds the image; the others run it"
    assert services["migrate"]["build"] in (".", {"context": "."})
    for name in ("gateway", "demo-upstream"):
        assert services[name]["pull_policy"] == "never", name  # no registry has it
    assert services["demo-upstream"]["command"] == [
        "demo-upstream",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
    ]
    # Every image a release, never a moving tag like `postgres:16` or `latest`.
    for service in services.values():
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+[\w.-]*|oncegate:local", service["image"])


def test_compose_gateway(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    command = gateway["command"]
    assert command[0] == "serve"
    assert option(command, "--host") == "0.0.0.0"
    config_path = option(command, "--config")
    assert mounts(gateway)[config_path] == GATEWAY_CONFIG
    published = {str(port).rsplit(":", 1)[-1] for port in gateway["ports"]}
    assert published == {"8080", "8081"}
    environment = gateway["environment"]
    assert re.fullmatch(r"\$\{ONCEGATE_ADMIN_TOKEN:-[^}]+\}", environment["ONCEGATE_ADMIN_TOKEN"])
    postgres = compose["services"]["postgres"]["environment"]
    assert environment["ONCEGATE_DATABASE_URL"] == (
        f"postgresql://{postgres['POSTGRES_USER']}:{postgres['POSTGRES_PASSWORD']}"
        f"@postgres:5432/{postgres['POSTGRES_DB']}"
    )
    assert (
        compose["services"]["migrate"]["environment"]["ONCEGATE_DATABASE_URL"]
        == environment["ONCEGATE_DATABASE_URL"]
    )


def test_compose_mounts_files_that_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for target, source in mounts(service).items():
            assert source.exists(), f"{name} mounts {source} at {target}; it does not exist"


def test_gateway_route_file_is_valid_and_points_at_demo_upstream(compose: dict[str, Any]) -> None:
    config = settings.load(environ={}, config_file=GATEWAY_CONFIG)
    assert {route.match for route in config.routes} >= {"/emails", "/tickets", "/charges"}
    demo_port = option(compose["services"]["demo-upstream"]["command"], "--port")
    for route in config.routes:
        assert route.upstream == f"http://demo-upstream:{demo_port}", route.name


def test_prometheus_scrapes_the_gateway_admin_port(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    config_path = option(prometheus["command"], "--config.file")
    assert mounts(prometheus)[config_path] == PROMETHEUS_CONFIG
    config = load_yaml(PROMETHEUS_CONFIG)
    admin_port = compose_admin_port(compose)
    targets = [
        (job.get("metrics_path", "/metrics"), target)
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    assert ("/metrics", f"gateway:{admin_port}") in targets


def test_prometheus_config_passes_promtool() -> None:
    promtool = required_binary("promtool")
    result = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    promtool = required_binary("promtool")
    for command in (["check", "rules", str(ALERT_RULES)], ["test", "rules", str(ALERT_RULES_TEST)]):
        result = subprocess.run(
            [promtool, *command], capture_output=True, text=True, timeout=60, cwd=HERE
        )
        assert result.returncode == 0, result.stdout + result.stderr
    rules = [rule for group in load_yaml(ALERT_RULES)["groups"] for rule in group["rules"]]
    unknown = {rule["alert"]: rule for rule in rules}["OncegateUnknownKeys"]
    assert metric_names(unknown["expr"]) == {"oncegate_keys"}
    assert 'state="unknown"' in unknown["expr"]


def test_prometheus_in_compose_loads_the_alert_rules(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    config_path = Path(option(prometheus["command"], "--config.file"))
    rule_files = load_yaml(PROMETHEUS_CONFIG)["rule_files"]
    # Relative rule files are read beside the config file, as promtool checked above.
    loaded = [str(config_path.parent / name) for name in rule_files]
    assert [mounts(prometheus).get(path) for path in loaded] == [ALERT_RULES]


def test_grafana_is_provisioned_with_the_dashboard(
    compose: dict[str, Any], dashboard: dict[str, Any]
) -> None:
    grafana = mounts(compose["services"]["grafana"])
    assert grafana["/etc/grafana/provisioning"] == GRAFANA_PROVISIONING
    providers = load_yaml(GRAFANA_PROVISIONING / "dashboards" / "oncegate.yml")["providers"]
    dashboard_dirs = {provider["options"]["path"] for provider in providers}
    dashboard_mounts = [target for target, source in grafana.items() if source == DASHBOARD]
    assert len(dashboard_mounts) == 1
    assert str(Path(dashboard_mounts[0]).parent) in dashboard_dirs

    datasources = load_yaml(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    used = {
        (item["datasource"]["type"], item["datasource"]["uid"])
        for item in [*dashboard["panels"], *targets_of(dashboard), *variables_of(dashboard)]
    }
    assert used == {("prometheus", datasource["uid"])}


def option(command: list[str], name: str) -> str:
    """The value of `--name VALUE` or `--name=VALUE` in an exec-form command."""
    for index, word in enumerate(command):
        if word == name:
            return command[index + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} missing from {command}")


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Bind mounts of the repository's files: container path -> file in the repository."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("."):
            found[target] = (ROOT / source).resolve()
    return found


def compose_admin_port(compose: dict[str, Any]) -> str:
    gateway = compose["services"]["gateway"]
    command = gateway["command"]
    return option(command, "--admin-port") if "--admin-port" in " ".join(command) else "8081"


# --- Dockerfile ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str

    def exec_form(self) -> list[str]:
        words: list[str] = json.loads(self.arguments)
        return words


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order: comments dropped, `\\` continuations joined."""
    instructions = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        keyword, _, arguments = whole.partition(" ")
        instructions.append(Instruction(keyword.upper(), arguments.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def dockerfile_healthcheck() -> list[str]:
    checks = [item for item in dockerfile() if item.keyword == "HEALTHCHECK"]
    if not checks:
        return []
    _, _, command = checks[-1].arguments.partition("CMD ")
    return json.loads(command) if command.startswith("[") else ["/bin/sh", "-c", command]


def healthcheck_here() -> list[str]:
    """The image's HEALTHCHECK command, run by this test's Python in place of the image's."""
    command = dockerfile_healthcheck()
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


def index_of(instructions: list[Instruction], predicate: Callable[[Instruction], bool]) -> int:
    for index, item in enumerate(instructions):
        if predicate(item):
            return index
    raise AssertionError("no such instruction in the Dockerfile")


def test_dockerfile_shape() -> None:
    instructions = dockerfile()
    keywords = [item.keyword for item in instructions]
    # A Python release on a Debian release, not the moving `python:3.11-slim`.
    assert re.fullmatch(
        r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", instructions[0].arguments
    )
    assert keywords.count("FROM") == 1

    copy_project = index_of(
        instructions, lambda item: item.keyword == "COPY" and "requirements.lock" in item.arguments
    )
    install_dependencies = index_of(
        instructions, lambda item: item.keyword == "RUN" and "pip install" in item.arguments
    )
    # Built from the lock: every version pinned, every file checked against its hash.
    assert "--require-hashes" in instructions[install_dependencies].arguments
    assert "-r requirements.lock" in instructions[install_dependencies].arguments
    copy_app = index_of(
        instructions, lambda item: item.keyword == "COPY" and item.arguments.startswith("app")
    )
    install_package = index_of(
        instructions,
        lambda item: item.keyword == "RUN" and "pip install --no-deps" in item.arguments,
    )
    assert copy_project < install_dependencies < copy_app < install_package, (
        "dependencies are installed, from the lock alone, before app/ is copied in"
    )
    assert "app/" not in instructions[copy_project].arguments

    users = [index for index, item in enumerate(instructions) if item.keyword == "USER"]
    assert users, "the image runs as root"
    assert instructions[users[-1]].arguments not in ("root", "0", "0:0")
    assert users[-1] < keywords.index("CMD")
    assert users[-1] < keywords.index("ENTRYPOINT")
    assert "RUN" not in keywords[users[-1] :], "nothing is installed as the unprivileged user"

    exposed = {
        port for item in instructions if item.keyword == "EXPOSE" for port in item.arguments.split()
    }
    assert exposed == {"8080", "8081"}
    entrypoint = instructions[keywords.index("ENTRYPOINT")].exec_form()
    assert entrypoint == ["oncegate"]
    assert instructions[keywords.index("CMD")].exec_form() == ["serve", "--host", "0.0.0.0"]


def test_dockerfile_healthcheck_is_the_packages_own() -> None:
    assert dockerfile_healthcheck() == ["python", "-m", "oncegate.healthcheck"], "slim has no curl"


def test_dockerfile_healthcheck_fails_when_nothing_listens() -> None:
    result = subprocess.run(
        [*healthcheck_here(), "--pid", str(os.getpid())],  # a process with no --admin-port
        env={**os.environ, "ONCEGATE_ADMIN_PORT": str(free_port())},
        capture_output=True,
        timeout=30,
    )
    assert result.returncode == 1


def test_dockerignore_lets_in_what_the_dockerfile_copies() -> None:
    lines = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "a build context of only what the image needs"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    for item in dockerfile():
        if item.keyword == "COPY":
            *sources, _ = item.arguments.split()
            for source in sources:
                assert source.rstrip("/") in allowed, f".dockerignore leaves out {source}"


# Replaying the install takes about 30 s with a warm pip cache, about a minute with a cold one:
# `make test-all`.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dockerfile_install_steps_give_a_working_oncegate(tmp_path: Path) -> None:
    """The Dockerfile's COPY and RUN pip steps, replayed in a fresh venv in place of the image's
    Python. Container paths are mapped under tmp_path; steps that change the system (useradd)
    are not replayed."""
    environment = venv_environment(tmp_path / "venv")
    workdir = tmp_path
    for item in dockerfile():
        if item.keyword == "WORKDIR":
            workdir = tmp_path / item.arguments.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif item.keyword == "ENV":
            for name, value in dockerfile_env(item.arguments).items():
                # The pip cache changes no result, and without it every run downloads again.
                if name != "PIP_NO_CACHE_DIR":
                    environment[name] = value
        elif item.keyword == "COPY":
            *sources, target = item.arguments.split()
            for source in sources:
                copy_into(ROOT / source, workdir / target, directory=target.endswith("/"))
        elif item.keyword == "RUN" and re.search(r"\bpip\b", item.arguments):
            result = subprocess.run(
                ["/bin/sh", "-c", item.arguments],
                cwd=workdir,
                env=environment,
                capture_output=True,
                text=True,
                timeout=840,
            )
            assert result.returncode == 0, f"RUN {item.arguments}\n{result.stdout}{result.stderr}"

    def run(*command: str) -> str:
        result = subprocess.run(
            command, cwd=workdir, env=environment, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"{command}\n{result.stdout}{result.stderr}"
        return result.stdout

    assert "serve" in run("oncegate", "--help")
    # Every dependency there, at a version that fits, but the embedded PostgreSQL, left out on
    # purpose; without a database URL the image says so instead of starting one.
    check = subprocess.run(
        ["python", "-m", "pip", "check"], cwd=workdir, env=environment, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert (
        check.stdout.strip().lower() == "oncegate 0.1.0 requires pgserver, which is not installed."
    )
    no_database = subprocess.run(
        ["oncegate", "serve", "--upstream", "http://127.0.0.1:9", "--port", str(free_port())],
        cwd=workdir, capture_output=True, text=True, timeout=60,
        env={**environment, "ONCEGATE_DATABASE_URL": "",
             "ONCEGATE_DATA_DIR": str(tmp_path / "data")},
    )  # fmt: skip
    assert no_database.returncode == 2, no_database.stderr
    assert "the embedded PostgreSQL (the pgserver package) is not installed here" in (
        no_database.stderr
    )
    assert not (tmp_path / "data").exists()  # nothing created for a server that cannot run
    # The installed package, not the copied source tree, with its migrations and SQL.
    probe = (
        "import oncegate.commands.cli, oncegate.store.migrate, oncegate.store.queries; "
        "print(oncegate.commands.cli.__file__); print(oncegate.store.migrate.head())"
    )
    location, head = run("python", "-c", probe).split()
    assert "site-packages" in location
    assert re.fullmatch(r"\w+", head)


def test_the_lock_pins_every_dependency_but_the_embedded_postgres() -> None:
    """requirements.lock (make lock) is in step with pyproject.toml: each dependency pinned at a
    version its specifier accepts, with hashes; pgserver left out of the image on purpose."""
    from packaging.requirements import Requirement

    lock = (ROOT / "requirements.lock").read_text()
    pins = dict(re.findall(r"^([a-z0-9][a-z0-9._-]*)==([^\s\\]+)", lock, re.MULTILINE))
    assert "--hash=sha256:" in lock
    assert re.search(r"(?m)^[a-z0-9][a-z0-9._-]*==[^\s]+ \\$", lock), "every pin has hashes"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name == "pgserver":
            assert name not in pins
            continue
        assert name in pins, f"{name} is not in requirements.lock: run make lock"
        assert requirement.specifier.contains(pins[name]), (name, pins[name])


def venv_environment(directory: Path) -> dict[str, str]:
    venv.EnvBuilder(with_pip=True, clear=True).create(directory)
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    environment["PATH"] = f"{directory / 'bin'}{os.pathsep}{environment.get('PATH', '')}"
    environment["VIRTUAL_ENV"] = str(directory)
    return environment


def dockerfile_env(arguments: str) -> dict[str, str]:
    words = shlex.split(arguments)
    if len(words) == 2 and "=" not in words[0]:
        return {words[0]: words[1]}  # the legacy `ENV NAME value` form
    return dict(word.split("=", 1) for word in words)


def copy_into(source: Path, target: Path, directory: bool) -> None:
    if source.is_dir():
        shutil.copytree(
            source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    else:
        destination = target / source.name if directory or target.is_dir() else target
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, destination)


# --- The dashboard ---------------------------------------------------------------------------

# What Grafana puts in place of its variables, for a Prometheus that scrapes every second.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$route": ".*"}


def targets_of(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [target for panel in dashboard["panels"] for target in panel.get("targets", [])]


def variables_of(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    variables: list[dict[str, Any]] = dashboard.get("templating", {}).get("list", [])
    return variables


def promql(expression: str) -> str:
    """The expression as Grafana sends it, with its variables filled in."""
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expression = expression.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expression, f"a Grafana variable this test does not know: {expression}"
    return expression


def exported_names() -> set[str]:
    """Every sample name the gateway's metrics can export."""
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
    }
    names = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                names.update(family.name + suffix for suffix in suffixes[family.type])
    return names


def metric_names(expression: str) -> set[str]:
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expression)
    return set(re.findall(r"\boncegate_[a-z0-9_]+\b", without_strings))


def test_dashboard_queries_name_real_metrics(dashboard: dict[str, Any]) -> None:
    exported = exported_names()
    used = set()
    for target in targets_of(dashboard):
        names = metric_names(target["expr"])
        assert names, f"a panel query that shows no oncegate metric: {target['expr']}"
        assert names <= exported, f"unknown metrics {names - exported} in {target['expr']}"
        promql(target["expr"])
        used |= names
    for variable in variables_of(dashboard):
        assert metric_names(variable["definition"]) <= exported
    shown = {re.sub(r"_(bucket|count|sum)$", "", name) for name in used}
    assert shown >= CONTRACT_METRICS, f"metrics left off the dashboard: {CONTRACT_METRICS - shown}"


def test_dashboard_panels_are_well_formed(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    assert dashboard["uid"] == "oncegate"
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]


# --- The dashboard against a real Prometheus and a real gateway ------------------------------


def required_binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        message = (
            f"`{name}` is not installed, so the dashboard's queries were not checked on a real "
            f"Prometheus; on Debian, as root: {INSTALL_PROMETHEUS}"
        )
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found


class AdminGateway:
    """A gateway with its admin port, started as `oncegate serve --admin-port` would be."""

    def __init__(
        self, directory: Path, database_url: str, routes: list[dict[str, Any]], **env: str
    ) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        config = directory / "gateway.yaml"
        config.write_text(yaml.safe_dump({"routes": routes}))
        self.process = Process(
            [
                "serve",
                "--config",
                str(config),
                "--port",
                str(self.port),
                "--admin-port",
                str(self.admin_port),
            ],
            directory / "gateway.log",
            env={"ONCEGATE_DATABASE_URL": database_url, **env},
        )
        try:
            self.process.wait_listening(self.port)
            self.process.wait_listening(self.admin_port)
        except BaseException:
            self.process.stop()
            raise


class Prometheus:
    """`prometheus` on loopback, scraping one target every second, with storage in `directory`."""

    def __init__(self, directory: Path, target: str, rule_files: tuple[Path, ...] = ()) -> None:
        binary = required_binary("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = directory / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(path) for path in rule_files],
                    "scrape_configs": [
                        {"job_name": "oncegate", "static_configs": [{"targets": [target]}]}
                    ],
                }
            )
        )
        self.log = directory / "prometheus.log"
        self._log_file = self.log.open("ab")
        self.popen = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=directory,
        )

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        def ready() -> bool:
            if self.popen.poll() is not None:
                raise RuntimeError(f"prometheus exited early:\n{self.log.read_text()}")
            try:
                return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, timeout, "prometheus to be ready")

    def query(self, expression: str) -> list[dict[str, Any]]:
        response = httpx.get(self.url + "/api/v1/query", params={"query": expression}, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (
            f"{expression}: {response.status_code} {body}"
        )
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self._log_file.close()


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


@pytest.fixture(scope="module")
def observed_gateway(
    tmp_path_factory: pytest.TempPathFactory, database_url: str
) -> Iterator[tuple[DemoUpstream, AdminGateway, Prometheus]]:
    """The demo upstream, a gateway in front of it and a Prometheus scraping its admin port."""
    tmp_path = tmp_path_factory.mktemp("observed")
    demo = DemoUpstream(tmp_path)
    stack: list[Callable[[], None]] = [demo.process.stop]
    try:
        routes = [
            {"name": name, "match": f"/{name}", "upstream": demo.url, "timeout": "10s"}
            for name in ("emails", "tickets")
        ]
        # Keys of this route expire almost at once, so the purger (every second here) has work.
        routes.append(
            {
                "name": "shortlived",
                "match": "/shortlived",
                "upstream": demo.url,
                "strip_prefix": True,
                "ttl": "2s",
                "timeout": "500ms",
            }
        )
        # Answers of this one come back after its timeout: its keys turn unknown.
        routes.append(
            {
                "name": "slowpay",
                "match": "/slowpay",
                "upstream": demo.url,
                "strip_prefix": True,
                "timeout": "500ms",
            }
        )
        gateway = AdminGateway(
            tmp_path,
            database_url,
            routes,
            ONCEGATE_PURGE_INTERVAL="1s",
            ONCEGATE_KEY_COUNT_INTERVAL="1s",
        )
        stack.append(gateway.process.stop)
        prometheus = Prometheus(
            tmp_path, f"127.0.0.1:{gateway.admin_port}", rule_files=(ALERT_RULES,)
        )
        stack.append(prometheus.stop)
        prometheus.wait_ready()
        yield demo, gateway, prometheus
    finally:
        for stop in reversed(stack):
            stop()


def send_traffic(client: httpx.Client, admin_url: str) -> None:
    """New keys, retries, a reused key, a missing key and a retry while the first is in flight,
    each answered as the contract says."""

    def post(path: str, key: str | None, body: dict[str, Any], **headers: str) -> httpx.Response:
        if key is not None:
            headers["Idempotency-Key"] = key
        return client.post(path, json=body, headers=headers)

    for route in ("emails", "tickets"):
        key = str(uuid.uuid4())
        assert post(f"/{route}", key, {"to": "ana"}).status_code == 201
        replayed = post(f"/{route}", key, {"to": "ana"})
        assert replayed.status_code == 201
        assert replayed.headers["idempotent-replayed"] == "true"
        assert post(f"/{route}", key, {"to": "bob"}).status_code == 422
        assert post(f"/{route}", None, {"to": "ana"}).status_code == 400
    assert post("/shortlived/emails", str(uuid.uuid4()), {"to": "ana"}).status_code == 201

    # A slow first request and its retry while it is in flight: 409, and one in-flight forward.
    key = str(uuid.uuid4())
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, "/emails", key, {"to": "cy"}, **{"X-Demo-Delay": "1"})
        # The retry goes once the first is being forwarded (claimed), not after a guess at how
        # long that takes: on a loaded machine the first had not arrived 0.3 s after it was sent.
        wait_for(
            lambda: total(httpx.get(admin_url + "/metrics").text, "oncegate_inflight_requests"),
            10,
            "the first request to be forwarded",
        )
        assert post("/emails", key, {"to": "cy"}).status_code == 409
        assert first.result().status_code == 201

    # A charge whose answer comes after the route's timeout: its key turns unknown.
    lost = post("/slowpay/charges", str(uuid.uuid4()), {"amount": 81}, **{"X-Demo-Delay": "2"})
    assert lost.status_code == 504


def scraped_requests(gateway: AdminGateway) -> float:
    """oncegate_requests_total summed, as the gateway's own /metrics says now."""
    return total(httpx.get(gateway.admin_url + "/metrics").text, "oncegate_requests_total")


def test_healthcheck_and_readiness_of_a_real_gateway(
    observed_gateway: tuple[DemoUpstream, AdminGateway, Prometheus],
) -> None:
    """The gateway was given `--admin-port` as a flag, and the variable names another port: the
    image's check follows the flag of the process it checks."""
    _, gateway, _ = observed_gateway
    result = subprocess.run(
        [*healthcheck_here(), "--pid", str(gateway.process.pid)],
        env={**os.environ, "ONCEGATE_ADMIN_PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert httpx.get(gateway.admin_url + "/readyz").status_code == 200


def test_every_dashboard_query_returns_data_after_traffic(
    observed_gateway: tuple[DemoUpstream, AdminGateway, Prometheus], dashboard: dict[str, Any]
) -> None:
    _, gateway, prometheus = observed_gateway
    wait_for(
        lambda: prometheus.query('up{job="oncegate"} == 1'),
        STARTUP_TIMEOUT,
        "prometheus to scrape the gateway's admin port",
    )
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        # Two rounds, each scraped: a rate needs a counter to grow between two samples.
        for _ in range(2):
            send_traffic(client, gateway.admin_url)
            total = scraped_requests(gateway)
            wait_for(
                lambda total=total: [
                    sample
                    for sample in prometheus.query("sum(oncegate_requests_total)")
                    if float(sample["value"][1]) >= total
                ],
                15,
                f"prometheus to scrape {total:g} requests",
            )
    wait_for(lambda: prometheus.query("oncegate_keys_purged_total > 0"), 15, "the purger to run")
    wait_for(
        lambda: prometheus.query('oncegate_keys{state="unknown"} > 0'),
        15,
        "the key count to see the unknown keys",
    )
    time.sleep(1.5)  # one more scrape after the last change, so every rate has its end point

    empty = []
    results: dict[str, list[dict[str, Any]]] = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            result = prometheus.query(promql(target["expr"]))
            results[f"{panel['title']}/{target['refId']}"] = result
            values = [float(sample["value"][1]) for sample in result]
            # Every panel shows something; all but the in-flight gauge (0 at rest) show a
            # number above zero after this traffic.
            shows_data = bool(values) and (
                "oncegate_inflight_requests" in target["expr"]
                or any(math.isfinite(value) and value > 0 for value in values)
            )
            if not shows_data:
                empty.append(f"{panel['title']}: {target['expr']} -> {result}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

    outcomes = {
        sample["metric"]["outcome"]
        for sample in results["Requests by outcome/A"]
        if float(sample["value"][1]) > 0
    }
    assert outcomes >= {"forwarded", "replayed", "mismatch", "missing_key", "in_progress"}
    reasons = {
        sample["metric"]["reason"] for sample in results["Duplicates blocked by route and reason/A"]
    }
    assert reasons >= {"replayed", "in_progress"}


@pytest.mark.slow  # the suite's own skip policy, run as a suite twice: `make test-all`
@pytest.mark.parametrize(("ci", "outcome"), [("", "1 skipped"), ("true", "1 failed")])
def test_without_prometheus_the_dashboard_tests_say_they_are_skipped_except_in_ci(
    tmp_path: Path, ci: str, outcome: str
) -> None:
    test = f"{Path(__file__)}::test_prometheus_config_passes_promtool"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test],
        cwd=ROOT,
        env={**os.environ, "PATH": str(tmp_path), "CI": ci},  # a PATH without promtool
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert outcome in result.stdout, result.stdout
    assert "`promtool` is not installed, so the dashboard's queries were not checked" in (
        " ".join(result.stdout.split())
    )


def test_the_unknown_key_alert_fires_on_a_real_gateway(
    observed_gateway: tuple[DemoUpstream, AdminGateway, Prometheus],
) -> None:
    """The example rule, loaded by a real Prometheus, turns pending once a key is unknown (it
    fires after its `for`, which the promtool unit test covers)."""
    _, gateway, prometheus = observed_gateway
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        lost = client.post(
            "/slowpay/charges",
            json={"amount": 81},
            headers={"Idempotency-Key": str(uuid.uuid4()), "X-Demo-Delay": "2"},
        )
    assert lost.status_code == 504
    wait_for(
        lambda: prometheus.query('ALERTS{alertname="OncegateUnknownKeys"}'),
        30,
        "the OncegateUnknownKeys alert to become pending",
    )
    (alert,) = prometheus.query('ALERTS{alertname="OncegateUnknownKeys"}')
    assert alert["metric"]["severity"] == "page"
