"""The `oncegate` commands as a user runs them: clear messages for mistakes, never a traceback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from oncegate.store import migrate
from tests.helpers import free_port, insert_completed_keys


def oncegate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    environment = {k: v for k, v in os.environ.items() if not k.startswith("ONCEGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "oncegate.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environment, **(env or {})},
    )


@pytest.mark.parametrize(
    ("config", "names"),
    [
        (
            "routes:\n  - name: a\n    match: /\n    upstrem: http://x\n",
            ["routes[0].upstrem", "unknown field"],
        ),
        (
            "routes:\n  - name: a\n    match: /\n    upstream: http://x\n    ttl: 0\n",
            ["routes[0].ttl"],
        ),
        (
            "routes:\n  - name: a\n    match: /\n    upstream: x.example\n",
            ["routes[0].upstream", "http"],
        ),
        (
            "routes:\n  - {name: a, match: /, upstream: 'http://x', timeout: 30s, lease: 10s}\n",
            ["lease", "timeout"],
        ),
        (
            "routes:\n  - {name: a, match: /, upstream: 'http://x', key: sometimes}\n",
            ["routes[0].key"],
        ),
        ("routes: [\n", ["not valid YAML"]),
        ("routes: []\n", ["no routes"]),
    ],
    ids=["typo", "zero-ttl", "no-scheme", "short-lease", "bad-key-policy", "bad-yaml", "no-routes"],
)
def test_a_bad_config_file_stops_serve_with_a_message_naming_the_field(
    tmp_path: Path, config: str, names: list[str]
) -> None:
    path = tmp_path / "oncegate.yaml"
    path.write_text(config)
    result = oncegate("serve", "--config", str(path), "--port", str(free_port()))
    assert result.returncode == 2
    for name in names:
        assert name in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_an_upstream_url_with_a_password_stops_serve(tmp_path: Path) -> None:
    result = oncegate("serve", "--upstream", "http://user:pw-1234@127.0.0.1:9")
    assert result.returncode == 2
    assert "must not carry credentials" in result.stderr
    assert "pw-1234" not in result.stderr + result.stdout and "Traceback" not in result.stderr


def test_a_bad_flag_value_is_named(tmp_path: Path) -> None:
    result = oncegate("serve", "--upstream", "http://127.0.0.1:9", "--ttl", "soon")
    assert result.returncode == 2
    assert "ttl" in result.stderr and "Traceback" not in result.stderr


def test_an_unreachable_database_stops_serve_with_a_message() -> None:
    result = oncegate(
        "serve", "--upstream", "http://127.0.0.1:9", "--port", str(free_port()),
        env={"ONCEGATE_DATABASE_URL": f"postgresql://nobody@127.0.0.1:{free_port()}/none"},
    )  # fmt: skip
    assert result.returncode == 3
    assert "PostgreSQL" in result.stderr and "Traceback" not in result.stderr


# A password no output may show any part of: four characters of it in a row are a leak.
PASSWORD_HEAD, PASSWORD_TAIL = "Hq7Zv", "Tw3Kp"
# Each `{}` is the password's separator, then a closed port: how the URL is written decides
# whether it is refused (2: it would be misread) or tried (3: no server listens there).
LEAKY_URLS = {
    "query-mark": ("postgresql://u:{head}?x={tail}@127.0.0.1:{port}/db", 2),
    "second-at": ("postgresql://u:{head}@{tail}@127.0.0.1:{port}/db", 2),
    "slash": ("postgresql://u:{head}/{tail}@127.0.0.1:{port}/db", 2),
    "hash": ("postgresql://u:{head}#{tail}@127.0.0.1:{port}/db", 2),
    "no-host": ("postgresql://u:{head}{tail}/db", 2),
    "encoded": ("postgresql://u:{head}%3Fx%3D%40{tail}@127.0.0.1:{port}/db", 3),
    "in-query": ("postgresql://u@127.0.0.1:{port}/db?password={head}{tail}", 3),
}


def leaked(output: str, password: str) -> list[str]:
    """Every run of four characters of `password` that `output` shows."""
    return sorted({password[i : i + 4] for i in range(len(password) - 3)} & {
        output[i : i + 4] for i in range(len(output) - 3)
    })  # fmt: skip


# Each way of writing the URL once, and each command both refusing a URL and failing to reach
# one (the three read the URL with the same code: the cross product would only repeat it). The
# last three, the same refusals again, in `make test-all`; every way of writing it is also read
# in tests/unit/test_database_descriptions.py.
COMMANDS_AND_URLS = [
    ("serve", "query-mark"),
    ("serve", "encoded"),
    ("migrate", "second-at"),
    ("migrate", "in-query"),
    ("purge", "no-host"),
    pytest.param("migrate", "slash", marks=pytest.mark.slow),
    pytest.param("purge", "hash", marks=pytest.mark.slow),
    pytest.param("purge", "encoded", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("command", "written"), COMMANDS_AND_URLS)
def test_no_part_of_a_database_password_is_ever_printed(command: str, written: str) -> None:
    template, status = LEAKY_URLS[written]
    url = template.format(head=PASSWORD_HEAD, tail=PASSWORD_TAIL, port=free_port())
    arguments = ["--upstream", "http://127.0.0.1:9", "--port", str(free_port()),
                 "--admin-port", str(free_port()), "--log-level", "debug"]  # fmt: skip
    result = oncegate(command, *(arguments if command == "serve" else []),
                      env={"ONCEGATE_DATABASE_URL": url})  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == status, output
    assert "Traceback" not in output
    # Every log line and message, in both streams; the password as written and as decoded.
    assert leaked(output, PASSWORD_HEAD + PASSWORD_TAIL) == []
    assert PASSWORD_HEAD not in output and PASSWORD_TAIL not in output
    if status == 2:
        assert "percent-encode" in output or "before an '@' and the host" in output
    else:
        assert "cannot connect to PostgreSQL: no server is listening there" in output


def test_migrate_on_an_unreachable_database_says_so_in_one_sentence_and_exits_3() -> None:
    url = f"postgresql://nobody@127.0.0.1:{free_port()}/none"  # a closed port
    for command in ("migrate", "purge"):  # the same words and status from both
        result = oncegate(command, env={"ONCEGATE_DATABASE_URL": url})
        assert result.returncode == 3, result.stderr
        assert result.stdout == ""
        assert result.stderr.splitlines()[-1] == (
            "oncegate: cannot connect to PostgreSQL: no server is listening there"
        )
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 2


def test_migrate_is_idempotent_and_serve_refuses_an_unmigrated_database(
    empty_database_url: str,
) -> None:
    env = {"ONCEGATE_DATABASE_URL": empty_database_url}
    refused = oncegate("serve", "--upstream", "http://127.0.0.1:9", "--port", str(free_port()),
                       env=env)  # fmt: skip
    assert refused.returncode == 2
    assert "oncegate migrate" in refused.stderr
    for _ in range(2):
        result = oncegate("migrate", env=env)
        assert result.returncode == 0, result.stderr
        assert f"schema revision {migrate.head()}" in result.stdout


def _previous(revision: str) -> str:
    """The revision before `revision`, as Alembic's scripts say."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(migrate.LOCATION))
    down = ScriptDirectory.from_config(config).get_revision(revision).down_revision
    assert isinstance(down, str)
    return down


@pytest.mark.parametrize("where", ["behind", "ahead"])
async def test_serve_refuses_a_database_behind_or_ahead_of_its_code(
    empty_database_url: str, where: str
) -> None:
    # Behind: migrated by an older release, really (downgraded one revision). Ahead: migrated by
    # a newer release, whose revision this code does not ship.
    await asyncio.to_thread(migrate.upgrade, empty_database_url)
    if where == "behind":
        revision = _previous(migrate.head())
        await asyncio.to_thread(migrate.downgrade, empty_database_url, revision)
    else:
        revision = "9999_newer"
        connection = await asyncpg.connect(empty_database_url)
        try:
            await connection.execute("UPDATE alembic_version SET version_num = $1", revision)
        finally:
            await connection.close()
    refused = await asyncio.to_thread(
        oncegate, "serve", "--upstream", "http://127.0.0.1:9", "--port", str(free_port()),
        "--admin-port", str(free_port()), env={"ONCEGATE_DATABASE_URL": empty_database_url},
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        f"oncegate: the database is at schema revision {revision}, this gateway needs "
        f"{migrate.head()}: run `oncegate migrate` first"
    )
    assert "Traceback" not in refused.stderr


async def test_purge_deletes_expired_keys_and_says_how_many(database_url: str) -> None:
    connection = await asyncpg.connect(database_url)
    try:
        await connection.execute("DELETE FROM oncegate_keys")
        await insert_completed_keys(
            connection, 30, "now() - interval '1 day 30 minutes' + n * interval '1 hour'"
        )  # rows 1-24 are expired, 25-30 are not
        result = oncegate("purge", env={"ONCEGATE_DATABASE_URL": database_url})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "purged 24 expired keys"
        assert await connection.fetchval("SELECT count(*) FROM oncegate_keys") == 6
    finally:
        await connection.close()


def test_version_and_help_say_what_each_command_does_and_its_defaults() -> None:
    from importlib import metadata

    version = oncegate("--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"oncegate {metadata.version('oncegate')}"

    wide = {"COLUMNS": "1000"}  # argparse wraps help to the terminal, hyphenated words too
    serve = oncegate("serve", "--help", env=wide).stdout
    assert "ONCEGATE_ADMIN_TOKEN enables the admin API" in serve
    assert "warning drops the per-request lines (default info)" in serve
    for command in ("migrate", "purge"):
        text = oncegate(command, "--help", env=wide).stdout
        # Both fall back to the embedded database, and say so (the old help said they used
        # ONCEGATE_DATABASE_URL only).
        assert "when it is unset, the embedded PostgreSQL in ONCEGATE_DATA_DIR" in text
    assert "Delete the keys past their TTL once" in oncegate("purge", "--help", env=wide).stdout
    demo = oncegate("demo-upstream", "--help", env=wide).stdout
    assert "GET /actions lists every action really performed" in demo
    assert "port (9000)" in demo and "(127.0.0.1)" in demo


@pytest.mark.parametrize(
    ("credentials", "query"),
    [("operator:UrlPassword42@", ""), ("UrlToken42@", ""), ("", "/?token=UrlToken42")],
)
def test_oncegate_keys_never_prints_the_credentials_of_an_admin_url(
    credentials: str, query: str
) -> None:
    """An admin port behind a proxy that wants credentials in its URL (basic credentials, a
    token as the user name or in the query): when it cannot be reached, the message names
    where, without them."""
    port = free_port()
    url = f"http://{credentials}127.0.0.1:{port}{query}"
    result = oncegate("keys", "--admin-url", url, "list", env={"ONCEGATE_ADMIN_TOKEN": "a-token"})
    assert result.returncode != 0
    where = f"{'***@' if credentials else ''}127.0.0.1:{port}{'/?token=***' if query else ''}"
    assert f"cannot reach the admin API at http://{where}:" in result.stderr
    assert "UrlPassword42" not in result.stderr + result.stdout
    assert "UrlToken42" not in result.stderr + result.stdout
