"""docs/reference.md stays true: every command, flag, variable, problem, outcome, metric and admin
path the code has is named there; and docs/operations.md's tables (section 2: settings and route
options) list every setting and route option where they list them. (A name the code lost is
found by reading; a name the doc lacks, here.)"""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

from fastapi.routing import APIRoute
from prometheus_client.metrics import MetricWrapperBase

from oncegate import settings
from oncegate.commands import cli
from oncegate.http import admin, ui
from oncegate.model import errors
from oncegate.model.outcomes import Outcome
from oncegate.telemetry import metrics

ROOT = Path(__file__).parents[2]
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()


def section(text: str, heading: str) -> str:
    """The part of a page under `heading` (a `## ` line), to the next `## `."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


def test_every_command_and_flag_is_in_the_reference() -> None:
    assert "`oncegate --version`" in REFERENCE
    for name, parser in subcommands().items():
        assert f"`oncegate {name}`" in REFERENCE, name
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert re.search(rf"`{re.escape(option)}[` ]", REFERENCE), (name, option)


def test_every_setting_has_its_variable_in_the_reference() -> None:
    for field in set(settings.Settings.model_fields) - {"routes", "otel_variables"}:
        assert f"`{settings.ENV_PREFIX}{field.upper()}`" in REFERENCE, field
        assert f"`{field}`" in REFERENCE, field
    for field in settings.Route.model_fields:
        assert f"`{field}`" in REFERENCE, field


def test_every_setting_and_route_option_is_in_the_operations_tables() -> None:
    configuration = table_rows(section(OPERATIONS, "2. Configuration reference"))
    for field in set(settings.Settings.model_fields) - {"routes", "otel_variables"}:
        variable = f"`{settings.ENV_PREFIX}{field.upper()}`"
        assert any(variable in row and f"`{field}`" in row for row in configuration), field
    for field in settings.Route.model_fields:
        assert any(row.startswith(f"| `{field}` |") for row in configuration), field
    # And the reference's sentence that names every route option, with the sections it sends to.
    routes = section(REFERENCE, "Routes (YAML)")
    for field in settings.Route.model_fields:
        assert f"`{field}`" in routes, field


def admin_paths() -> list[tuple[str, str]]:
    """Every (method, path) the admin port serves, `{id}` for the path's key id."""
    found = []
    for route in [*admin.router.routes, *ui.router.routes]:
        assert isinstance(route, APIRoute)
        for method in route.methods:
            found.append((method, route.path.replace("{record_id}", "{id}")))
    return found


def test_every_admin_path_is_in_the_reference_s_admin_table() -> None:
    rows = table_rows(section(REFERENCE, "The admin port"))
    listed = [row.split("|")[1].strip().strip("`") for row in rows]
    for method, path in admin_paths():
        assert any(
            entry == f"{method} {path}" or entry.startswith(f"{method} {path}?") for entry in listed
        ), (method, path)
    # The queue's and the look-up's query parameters, each spelled in the table.
    parameters = inspect.signature(admin.find_keys).parameters
    for name in set(parameters) - {"runtime"}:
        assert any(f"{name}=" in entry for entry in listed), name


def problems() -> list[type[errors.GatewayError]]:
    found: list[type[errors.GatewayError]] = []
    pending = [errors.GatewayError]
    while pending:
        kind = pending.pop()
        found.append(kind)
        pending.extend(kind.__subclasses__())
    return found


def test_every_problem_and_outcome_is_in_the_reference() -> None:
    for kind in problems():
        assert f"`{kind.name}`" in REFERENCE, kind
        assert f"`{kind.outcome}`" in REFERENCE, kind
    # Every outcome the gateway can count a request under is a member of `Outcome`: the
    # answers it relays as much as its own problems (whose `outcome` is typed `Outcome`).
    for outcome in Outcome:
        assert f"`{outcome.value}`" in REFERENCE, outcome
    relayed = {Outcome.PASSTHROUGH, Outcome.UNPROTECTED, Outcome.FORWARDED, Outcome.RELEASED,
               Outcome.REPLAYED}  # fmt: skip
    assert {kind.outcome for kind in problems()} | relayed == set(Outcome)
    for reason in metrics.BLOCK_REASONS:
        assert f"`{reason}`" in REFERENCE, reason


def test_every_metric_is_in_the_reference() -> None:
    found = [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]
    assert len(found) >= 7
    for metric in found:
        name = metric._name + ("_total" if metric._type == "counter" else "")
        assert f"`{name}`" in REFERENCE, name
        for label in metric._labelnames:
            assert f"`{label}`" in REFERENCE, (name, label)


def test_the_docs_link_only_to_what_the_repository_holds() -> None:
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        text = page.read_text()
        assert "../shared" not in text and "CONTRACT.md" not in text, page
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (page.parent / target).exists(), (page, target)
