"""deploy/kubernetes/, checked offline: every object validates against the Kubernetes API's own
schemas (the `kubernetes-validate` package ships them, strict: an unknown field is an error), and
the manifests say what the gateway needs: probes on the admin port's /readyz and /healthz, a
preStop drain the grace period covers, the admin port out of the Service, a disruption budget
that selects the gateway's pods, a migration Job, and every secret they read present in the
Secret. The routes of the ConfigMap load with oncegate's own settings loader, and the container
arguments with its own command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from oncegate import settings
from oncegate.commands import cli
from oncegate.settings import database_url

DIRECTORY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# The oldest Kubernetes release still commonly run, and the newest the package knows.
VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]


def documents() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for path in sorted(DIRECTORY.glob("*.yaml")):
        found.extend(document for document in yaml.safe_load_all(path.read_text()) if document)
    return found


def one(kind: str, name: str = "oncegate") -> dict[str, Any]:
    [found] = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container(kind: str, name: str = "oncegate") -> dict[str, Any]:
    [found] = one(kind, name)["spec"]["template"]["spec"]["containers"]
    return found


def seconds(duration: str) -> float:
    return settings.parse_duration(duration)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(version: str) -> None:
    kinds = set()
    for document in documents():
        kubernetes_validate.validate(document, version, strict=True)
        kinds.add(document["kind"])
    assert kinds >= {"Deployment", "Service", "PodDisruptionBudget", "Job", "Secret",
                     "ConfigMap", "NetworkPolicy"}  # fmt: skip


def test_a_manifest_with_a_mistake_is_refused() -> None:
    broken = one("Deployment")
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


def test_probes_are_readyz_and_healthz_on_the_admin_port() -> None:
    gateway = container("Deployment")
    ports = {port["name"]: port["containerPort"] for port in gateway["ports"]}
    assert ports == {"proxy": 8080, "admin": 8081}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    arguments = cli._parser().parse_args(gateway["args"])
    assert isinstance(arguments, argparse.Namespace)
    assert (arguments.port, arguments.admin_port, arguments.host) == (8080, 8081, "0.0.0.0")


def test_the_grace_period_covers_the_drain_and_the_longest_route_timeout() -> None:
    pod = one("Deployment")["spec"]["template"]["spec"]
    sleep = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    config = yaml.safe_load(one("ConfigMap")["data"]["oncegate.yaml"])
    longest = max(seconds(route.get("timeout", "30s")) for route in config["routes"])
    assert pod["terminationGracePeriodSeconds"] > float(sleep[1]) + longest


def test_the_routes_load_with_oncegates_own_loader(tmp_path: Path) -> None:
    path = tmp_path / "oncegate.yaml"
    path.write_text(one("ConfigMap")["data"]["oncegate.yaml"])
    loaded = settings.load({}, environ={}, config_file=path)
    assert [route.name for route in loaded.routes] == ["payments", "emails"]


def test_the_admin_port_is_not_in_the_service_and_only_monitoring_reaches_it() -> None:
    service = one("Service")
    assert [port["targetPort"] for port in service["spec"]["ports"]] == ["proxy"]
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == labels
    rules = one("NetworkPolicy")["spec"]["ingress"]
    admin = [rule for rule in rules if {"port": "admin", "protocol": "TCP"} in rule["ports"]]
    assert len(admin) == 1 and admin[0]["from"], "the admin port must name who may reach it"


def test_the_disruption_budget_selects_the_gateways_pods() -> None:
    budget = one("PodDisruptionBudget")["spec"]
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget["maxUnavailable"] == 1
    assert one("Deployment")["spec"]["replicas"] > 1


def test_the_job_migrates_and_every_secret_read_is_in_the_secret() -> None:
    assert container("Job", "oncegate-migrate")["args"] == ["migrate"]
    secret = one("Secret")["stringData"]
    for found in (container("Deployment"), container("Job", "oncegate-migrate")):
        for variable in found["env"]:
            reference = variable["valueFrom"]["secretKeyRef"]
            assert reference["name"] == "oncegate" and reference["key"] in secret
    database_url.parse(secret["database-url"])  # the example URL is one the gateway takes


def test_resources_are_requested_and_memory_is_limited() -> None:
    for found in (container("Deployment"), container("Job", "oncegate-migrate")):
        assert {"cpu", "memory"} <= found["resources"]["requests"].keys()
        assert "memory" in found["resources"]["limits"]
        assert found["securityContext"]["readOnlyRootFilesystem"] is True
