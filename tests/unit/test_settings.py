"""oncegate.settings (contract sections 2 and 3) and the route table of oncegate.service.routing."""

from __future__ import annotations

from pathlib import Path

import pytest

from oncegate import settings
from oncegate.model import errors
from oncegate.service import routing
from oncegate.settings import units

UPSTREAM = "http://127.0.0.1:9001"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "oncegate.yaml"
    path.write_text(text)
    return path


def route(**fields: object) -> settings.Route:
    return settings.Route.model_validate(
        {"name": "r", "match": "/", "upstream": UPSTREAM, **fields}
    )


def load_error(
    tmp_path: Path,
    text: str | None = None,
    *,
    flags: dict[str, object] | None = None,
    environ: dict[str, str] | None = None,
) -> str:
    path = write(tmp_path, text) if text is not None else None
    with pytest.raises(errors.ConfigError) as caught:
        settings.load(flags or {}, environ or {}, path)
    return str(caught.value)


# -- durations and sizes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90.0),
        ("15m", 900.0),
        ("24h", 86_400.0),
        ("7d", 604_800.0),
        ("250ms", 0.25),
        ("1.5h", 5_400.0),
        ("45", 45.0),
        (" 10s ", 10.0),
        (30, 30.0),
        (2.5, 2.5),
    ],
)
def test_parse_duration(text: object, seconds: float) -> None:
    assert settings.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "s", "10x", "ten seconds", "-5s", "5 hours", "1e3s", "10s5", "nan", True]
)
def test_bad_duration(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        settings.parse_duration(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512KiB", 512 * 1024),
        ("10MiB", 10 * 1024 * 1024),
        ("1GiB", 1024**3),
        ("4096", 4096),
        ("100B", 100),
        ("2KB", 2000),
        (8192, 8192),
    ],
)
def test_parse_size(text: object, size: int) -> None:
    assert settings.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "1.5MiB", "10 parsecs", "-1", "10kib", False])
def test_bad_size(text: object) -> None:
    with pytest.raises(ValueError, match="size"):
        settings.parse_size(text)


# -- one route from --upstream ----------------------------------------------------------------


def test_upstream_alone_is_one_catch_all_route_named_default() -> None:
    loaded = settings.load({"upstream": UPSTREAM + "/"}, {}, None)
    assert len(loaded.routes) == 1
    (default,) = loaded.routes
    assert default.name == "default"
    assert default.match == "/"
    assert default.upstream == UPSTREAM
    table = routing.RouteTable(loaded.routes)
    assert table.match("/") is default
    assert table.match("/anything/at/all") is default


def test_upstream_from_a_variable_is_the_same() -> None:
    loaded = settings.load({}, {"ONCEGATE_UPSTREAM": UPSTREAM}, None)
    assert [(r.name, r.match, r.upstream) for r in loaded.routes] == [("default", "/", UPSTREAM)]


def test_upstream_alongside_file_routes_adds_default(tmp_path: Path) -> None:
    path = write(tmp_path, f"routes:\n  - name: pay\n    match: /pay\n    upstream: {UPSTREAM}\n")
    loaded = settings.load({"upstream": "http://127.0.0.1:9002"}, {}, path)
    assert sorted(r.name for r in loaded.routes) == ["default", "pay"]
    table = routing.RouteTable(loaded.routes)
    assert table.match("/pay/x").name == "pay"  # type: ignore[union-attr]
    assert table.match("/other").name == "default"  # type: ignore[union-attr]


# -- route defaults ---------------------------------------------------------------------------


def test_route_defaults_are_the_contracts() -> None:
    default = settings.load({"upstream": UPSTREAM}, {}, None).routes[0]
    assert default.methods == {"POST", "PATCH"}
    assert default.key == "required"
    assert default.ttl == 24 * 3600
    assert default.timeout == 30
    assert default.lease_seconds == 60
    assert default.max_body == 10 * 1024 * 1024
    assert default.max_stored_response == 10 * 1024 * 1024
    assert default.release_statuses == {429, 503}
    assert default.on_unknown == "reject"
    assert [name.lower() for name in default.scope_headers] == ["authorization"]
    assert default.strip_prefix is False


def test_lease_defaults_to_twice_the_timeout() -> None:
    assert route(timeout="45s").lease_seconds == 90
    assert route(timeout="10s", lease="25s").lease_seconds == 25


def test_route_fields_from_yaml(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""
routes:
  - name: payments
    match: /payments/
    upstream: {UPSTREAM}
    strip_prefix: true
    methods: [post, PUT]
    key: optional
    ttl: 2h
    timeout: 5s
    lease: 20s
    max_body: 512KiB
    max_stored_response: 1MiB
    scope_headers: [Authorization, X-Tenant]
    release_statuses: [429, 500]
    on_unknown: forward
""",
    )
    (payments,) = settings.load({}, {}, path).routes
    assert payments.name == "payments"
    assert payments.match == "/payments/"
    assert payments.strip_prefix is True
    assert payments.methods == {"POST", "PUT"}
    assert payments.key == "optional"
    assert payments.ttl == 7200
    assert payments.timeout == 5
    assert payments.lease_seconds == 20
    assert payments.max_body == 512 * 1024
    assert payments.max_stored_response == 1024 * 1024
    assert [name.lower() for name in payments.scope_headers] == ["authorization", "x-tenant"]
    assert payments.release_statuses == {429, 500}
    assert payments.on_unknown == "forward"


def test_route_without_ttl_takes_the_top_level_ttl(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""
ttl: 2h
routes:
  - name: inherits
    match: /a
    upstream: {UPSTREAM}
  - name: own
    match: /b
    upstream: {UPSTREAM}
    ttl: 15m
""",
    )
    loaded = settings.load({}, {}, path)
    ttls = {r.name: r.ttl for r in loaded.routes}
    assert ttls == {"inherits": 7200, "own": 900}


def test_ttl_flag_is_the_default_ttl_of_routes(tmp_path: Path) -> None:
    path = write(
        tmp_path, f"ttl: 2h\nroutes:\n  - name: a\n    match: /a\n    upstream: {UPSTREAM}\n"
    )
    loaded = settings.load({"ttl": "3h"}, {}, path)
    assert loaded.ttl == 3 * 3600
    assert loaded.routes[0].ttl == 3 * 3600
    assert settings.load({"upstream": UPSTREAM, "ttl": "7d"}, {}, None).routes[0].ttl == 604_800


# -- precedence: flags > ONCEGATE_* > file ----------------------------------------------------


def _file_with_everything(tmp_path: Path) -> Path:
    return write(
        tmp_path,
        f"""
port: 1111
admin_port: 2111
ttl: 1h
host: 10.0.0.1
routes:
  - name: a
    match: /a
    upstream: {UPSTREAM}
""",
    )


def test_file_values_apply_when_nothing_else_is_given(tmp_path: Path) -> None:
    loaded = settings.load({}, {}, _file_with_everything(tmp_path))
    assert (loaded.port, loaded.admin_port, loaded.ttl, loaded.host) == (
        1111,
        2111,
        3600,
        "10.0.0.1",
    )


def test_variables_beat_the_file(tmp_path: Path) -> None:
    environ = {"ONCEGATE_PORT": "1222", "ONCEGATE_TTL": "2h"}
    loaded = settings.load({}, environ, _file_with_everything(tmp_path))
    assert loaded.port == 1222
    assert loaded.ttl == 7200
    assert loaded.routes[0].ttl == 7200
    assert loaded.admin_port == 2111  # not overridden: still the file's
    assert loaded.host == "10.0.0.1"


def test_flags_beat_variables_and_the_file(tmp_path: Path) -> None:
    environ = {"ONCEGATE_PORT": "1222", "ONCEGATE_TTL": "2h", "ONCEGATE_ADMIN_PORT": "2222"}
    flags = {"port": 1333, "ttl": "3h", "admin_port": None}
    loaded = settings.load(flags, environ, _file_with_everything(tmp_path))
    assert loaded.port == 1333
    assert loaded.ttl == 3 * 3600
    assert loaded.routes[0].ttl == 3 * 3600
    assert loaded.admin_port == 2222  # a flag left unset (None) does not hide the variable


def test_defaults_without_file_flags_or_variables() -> None:
    loaded = settings.load({"upstream": UPSTREAM}, {}, None)
    assert loaded.port == 8080
    assert loaded.admin_port == 8081
    assert loaded.host == "127.0.0.1"
    assert loaded.database_url is None
    assert loaded.admin_token is None


def test_variables_for_database_and_admin_token() -> None:
    environ = {
        "ONCEGATE_DATABASE_URL": "postgresql://u@localhost/oncegate",
        "ONCEGATE_ADMIN_TOKEN": "secret",
        "ONCEGATE_DATA_DIR": "/var/lib/oncegate",
    }
    loaded = settings.load({"upstream": UPSTREAM}, environ, None)
    assert loaded.database_url == "postgresql://u@localhost/oncegate"
    assert loaded.admin_token == "secret"
    assert loaded.data_dir == Path("/var/lib/oncegate")


def test_the_database_part_needs_no_routes_and_resolves_as_serve_does() -> None:
    """`migrate`, `purge`, `rekey` and the agent's checkpoints read the same variables, checked
    by the same validators, as `serve`."""
    environ = {"ONCEGATE_DATABASE_URL": "postgresql://u@localhost/oncegate", "XDG_DATA_HOME": "/x"}
    part = settings.load_part(settings.DatabaseSettings, environ)
    served = settings.load({"upstream": UPSTREAM}, environ, None)
    assert (part.database_url, part.data_dir) == (served.database_url, served.data_dir)
    assert settings.load_part(settings.DatabaseSettings, {"XDG_DATA_HOME": "/x"}).data_dir == (
        settings.default_data_dir({"XDG_DATA_HOME": "/x"})
    )
    with pytest.raises(errors.ConfigError, match="must be a postgresql:// URL"):
        settings.load_part(settings.DatabaseSettings, {"ONCEGATE_DATABASE_URL": "mysql://x/y"})
    with pytest.raises(errors.ConfigError, match="encryption_keys"):
        settings.load_part(settings.SealingSettings, {"ONCEGATE_ENCRYPTION_KEYS": "nonsense"})


def test_config_file_from_variable(tmp_path: Path) -> None:
    path = _file_with_everything(tmp_path)
    loaded = settings.load({}, {"ONCEGATE_CONFIG": str(path)}, None)
    assert [r.name for r in loaded.routes] == ["a"]


def test_config_file_from_flag(tmp_path: Path) -> None:
    path = _file_with_everything(tmp_path)
    loaded = settings.load({"config": str(path)}, {}, None)
    assert [r.name for r in loaded.routes] == ["a"]


def test_load_does_not_read_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCEGATE_PORT", "1999")
    assert settings.load({"upstream": UPSTREAM}, {}, None).port == 8080


# -- errors name the field --------------------------------------------------------------------


def test_typo_field_is_named(tmp_path: Path) -> None:
    message = load_error(tmp_path, f"routes:\n  - name: a\n    match: /\n    upstrem: {UPSTREAM}\n")
    assert "routes[0].upstrem" in message
    assert "unknown field" in message
    assert "routes[0].upstream" in message  # and the field it lacks because of the typo


def test_typo_in_second_route_is_named(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        f"""
routes:
  - name: a
    match: /a
    upstream: {UPSTREAM}
  - name: b
    match: /b
    upstream: {UPSTREAM}
    tll: 1h
""",
    )
    assert "routes[1].tll" in message
    assert "unknown field" in message


def test_unknown_top_level_field_is_named(tmp_path: Path) -> None:
    message = load_error(tmp_path, f"prot: 80\nupstream: {UPSTREAM}\n")
    assert "prot" in message
    assert "unknown field" in message


@pytest.mark.parametrize("ttl", ["0", "0s", "0ms", "-1"])
def test_ttl_of_zero_is_refused(tmp_path: Path, ttl: str) -> None:
    message = load_error(
        tmp_path, f"routes:\n  - name: a\n    match: /\n    upstream: {UPSTREAM}\n    ttl: {ttl}\n"
    )
    assert "routes[0].ttl" in message


def test_top_level_ttl_of_zero_is_refused() -> None:
    message = load_error(Path(), flags={"upstream": UPSTREAM, "ttl": "0s"})
    assert "ttl" in message


def test_infinite_ttl_is_refused(tmp_path: Path) -> None:
    message = load_error(
        tmp_path, f"routes:\n  - name: a\n    match: /\n    upstream: {UPSTREAM}\n    ttl: .inf\n"
    )
    assert "routes[0].ttl" in message


@pytest.mark.parametrize(
    "upstream", ["127.0.0.1:9001", "localhost:9001", "ftp://example.com", "http://", "/just/path"]
)
def test_upstream_without_scheme_or_host_is_refused(tmp_path: Path, upstream: str) -> None:
    message = load_error(
        tmp_path, f"routes:\n  - name: a\n    match: /\n    upstream: '{upstream}'\n"
    )
    assert "routes[0].upstream" in message


@pytest.mark.parametrize(
    "upstream", ["http://user:s3cret@127.0.0.1:9001", "http://s3cret@127.0.0.1:9001/api",
                 "https://:s3cret@example.com"]
)  # fmt: skip
def test_upstream_with_credentials_is_refused_without_echoing_them(
    tmp_path: Path, upstream: str
) -> None:
    message = load_error(
        tmp_path, f"routes:\n  - name: a\n    match: /\n    upstream: '{upstream}'\n"
    )
    assert "routes[0].upstream" in message and "must not carry credentials" in message
    assert "s3cret" not in message
    assert "s3cret" not in load_error(Path(), flags={"upstream": upstream})


@pytest.mark.parametrize(
    ("upstream", "said"),
    [
        # An API key in the query, refused for the query: said with the names, not the values.
        ("https://api.test/v1?api_key=s3cret&region=eu", "'https://api.test/v1?api_key=***&region=***'"),
        ("https://api.test/v1#s3cret", "'https://api.test/v1#***'"),
        # Refused for its scheme before its query is looked at.
        ("ftp://api.test/v1?token=s3cret", "'ftp://api.test/v1?token=***' is not an http://"),
        ("api.test/v1?token=s3cret", "'api.test/v1?token=***' is not an http://"),
    ],
)  # fmt: skip
def test_an_upstream_refused_is_said_without_its_querys_values(
    tmp_path: Path, upstream: str, said: str
) -> None:
    message = load_error(
        tmp_path, f"routes:\n  - name: a\n    match: /\n    upstream: '{upstream}'\n"
    )
    assert "routes[0].upstream" in message and said in message
    assert "s3cret" not in message
    flagged = load_error(Path(), flags={"upstream": upstream})
    assert said in flagged and "s3cret" not in flagged


def test_a_jwks_url_refused_is_said_without_its_querys_values(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        "routes:\n  - {name: a, match: /, upstream: 'http://u.test', scope_jwt: {issuer: x,"
        " jwks_url: 'ftp://issuer.test/jwks?token=s3cret'}}\n",
    )
    assert "'ftp://issuer.test/jwks?token=***' is not an http://" in message
    assert "s3cret" not in message


def test_upstream_flag_without_scheme_is_refused() -> None:
    message = load_error(Path(), flags={"upstream": "localhost:9001"})
    assert "upstream" in message


@pytest.mark.parametrize(("timeout", "lease"), [("30s", "30s"), ("30s", "10s"), ("1m", "59s")])
def test_lease_must_exceed_timeout(tmp_path: Path, timeout: str, lease: str) -> None:
    message = load_error(
        tmp_path,
        f"routes:\n  - name: a\n    match: /\n    upstream: {UPSTREAM}\n"
        f"    timeout: {timeout}\n    lease: {lease}\n",
    )
    assert "routes[0]" in message
    assert "lease" in message
    assert "timeout" in message


@pytest.mark.parametrize(
    "fields",
    [
        "    ttl: 60s\n",  # the default lease is 2 x 30s = 60s: equal is not enough
        "    ttl: 1m\n    timeout: 10s\n    lease: 2m\n",
    ],
    ids=["equal-to-default-lease", "below-lease"],
)
def test_ttl_must_exceed_lease(tmp_path: Path, fields: str) -> None:
    message = load_error(
        tmp_path, f"routes:\n  - name: a\n    match: /\n    upstream: {UPSTREAM}\n" + fields
    )
    assert "routes[0]" in message
    assert "ttl" in message
    assert "lease" in message


def test_short_ttl_is_fine_above_the_lease() -> None:
    short = route(ttl="30s", timeout="10s")
    assert (short.ttl, short.lease_seconds) == (30, 20)


def test_duplicate_route_names_are_refused(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        f"""
routes:
  - name: same
    match: /a
    upstream: {UPSTREAM}
  - name: same
    match: /b
    upstream: {UPSTREAM}
""",
    )
    assert "routes" in message
    assert "'same'" in message


def test_duplicate_matches_are_refused(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        f"""
routes:
  - name: a
    match: /x
    upstream: {UPSTREAM}
  - name: b
    match: /x
    upstream: {UPSTREAM}
""",
    )
    assert "'/x'" in message


def test_upstream_flag_and_a_file_route_named_default_clash(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        f"routes:\n  - name: default\n    match: /a\n    upstream: {UPSTREAM}\n",
        flags={"upstream": UPSTREAM},
    )
    assert "default" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("key", "sometimes"),
        ("on_unknown", "retry"),
        ("match", "payments"),
        ("name", "has space"),
        ("methods", "[GET, 'P OST']"),
        ("release_statuses", "[999]"),
        ("max_body", "lots"),
        ("max_body", "0"),
        ("timeout", "soon"),
        ("scope_headers", "['Bad Header']"),
    ],
)
def test_bad_route_field_is_named(tmp_path: Path, field: str, value: str) -> None:
    route_fields = {"name": "a", "match": "/", "upstream": UPSTREAM, field: value}
    body = "".join(f"    {name}: {text}\n" for name, text in route_fields.items())
    message = load_error(tmp_path, "routes:\n  - " + body.lstrip())
    assert f"routes[0].{field}" in message


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_document_is_refused(tmp_path: Path, text: str) -> None:
    message = load_error(tmp_path, text)
    assert "mapping" in message
    assert str(tmp_path / "oncegate.yaml") in message


@pytest.mark.parametrize("text", ["routes: [\n", "routes:\n  - name: a\n   match: : :\n", "\t- x"])
def test_invalid_yaml_is_refused(tmp_path: Path, text: str) -> None:
    message = load_error(tmp_path, text)
    assert "YAML" in message


def test_missing_file_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.yaml"
    with pytest.raises(errors.ConfigError) as caught:
        settings.load({}, {}, missing)
    assert str(missing) in str(caught.value)


def test_routes_that_are_not_a_list_are_refused(tmp_path: Path) -> None:
    message = load_error(tmp_path, "routes:\n  name: a\n")
    assert "routes" in message


@pytest.mark.parametrize("text", ["", "ttl: 1h\n", "routes: []\n"])
def test_no_routes_at_all_is_refused(tmp_path: Path, text: str) -> None:
    message = load_error(tmp_path, text)
    assert "no routes" in message


def test_nothing_given_is_refused() -> None:
    with pytest.raises(errors.ConfigError, match="no routes"):
        settings.load({}, {}, None)


def test_config_error_is_not_a_traceback(tmp_path: Path) -> None:
    message = load_error(tmp_path, f"routes:\n  - name: a\n    match: /\n    upstrem: {UPSTREAM}\n")
    assert "Traceback" not in message
    assert "pydantic" not in message.lower()


# -- the route table --------------------------------------------------------------------------


@pytest.fixture
def table() -> routing.RouteTable:
    return routing.RouteTable(
        [
            route(name="root", match="/"),
            route(name="pay", match="/pay"),
            route(name="pay-refunds", match="/pay/refunds"),
            route(name="payments", match="/payments/"),
        ]
    )


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/pay", "pay"),
        ("/pay/", "pay"),
        ("/pay/x", "pay"),
        ("/pay/refunds", "pay-refunds"),
        ("/pay/refunds/7", "pay-refunds"),
        ("/pay/refundsx", "pay"),
        ("/payments/", "payments"),
        ("/payments/charges", "payments"),
        ("/paymentsx", "root"),
        ("/pa", "root"),
        ("/", "root"),
        ("/other", "root"),
    ],
)
def test_longest_whole_segment_prefix_wins(table: routing.RouteTable, path: str, name: str) -> None:
    matched = table.match(path)
    assert matched is not None
    assert matched.name == name


def test_pay_does_not_match_payments() -> None:
    table = routing.RouteTable([route(name="pay", match="/pay")])
    assert table.match("/pay").name == "pay"  # type: ignore[union-attr]
    assert table.match("/pay/x").name == "pay"  # type: ignore[union-attr]
    assert table.match("/payments") is None
    assert table.match("/") is None


def test_order_of_routes_does_not_matter() -> None:
    short, long = route(name="short", match="/a"), route(name="long", match="/a/b")
    for routes in ([short, long], [long, short]):
        assert routing.RouteTable(routes).match("/a/b/c").name == "long"  # type: ignore[union-attr]


def test_no_route_matches() -> None:
    assert routing.RouteTable([]).match("/x") is None


# -- upstream URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("match", "strip", "path", "query", "expected"),
    [
        ("/payments/", True, "/payments/charges", "", UPSTREAM + "/charges"),
        ("/payments/", False, "/payments/charges", "", UPSTREAM + "/payments/charges"),
        ("/pay", True, "/pay/x/y", "a=1&b=2", UPSTREAM + "/x/y?a=1&b=2"),
        ("/pay", True, "/pay", "", UPSTREAM + "/"),
        ("/pay", True, "/pay", "a=1", UPSTREAM + "/?a=1"),
        ("/", True, "/emails", "", UPSTREAM + "/emails"),
        ("/", False, "/emails", "q=", UPSTREAM + "/emails?q="),
    ],
)
def test_upstream_url(match: str, strip: bool, path: str, query: str, expected: str) -> None:
    assert routing.upstream_url(route(match=match, strip_prefix=strip), path, query) == expected


def test_upstream_url_keeps_the_upstream_base_path() -> None:
    based = route(match="/payments/", strip_prefix=True, upstream="http://h:1/api/")
    assert routing.upstream_url(based, "/payments/charges", "") == "http://h:1/api/charges"


def test_the_prefix_itself_is_the_upstream_resource_without_a_slash_added() -> None:
    """`/checkout/payments` on a route to `https://host/payments` is `https://host/payments`,
    the create an SDK meant; `/payments/` would be another resource to many APIs."""
    based = route(match="/checkout/payments", strip_prefix=True, upstream="http://h:1/payments")
    assert routing.upstream_url(based, "/checkout/payments", "") == "http://h:1/payments"
    assert routing.upstream_url(based, "/checkout/payments", "a=1") == "http://h:1/payments?a=1"
    assert routing.upstream_url(based, "/checkout/payments/", "") == "http://h:1/payments/"
    assert routing.upstream_url(based, "/checkout/payments/p_1", "") == "http://h:1/payments/p_1"


def test_the_default_data_directory_is_the_users_never_the_working_directory() -> None:
    user = 1000
    assert settings.default_data_dir({"XDG_DATA_HOME": "/data/ana"}, user) == Path(
        "/data/ana/oncegate"
    )
    home = Path.home()
    for environ in ({}, {"XDG_DATA_HOME": ""}, {"XDG_DATA_HOME": "relative/ignored"}):
        expected = home / ".local" / "share" / "oncegate"
        assert settings.default_data_dir(environ, user) == expected
    assert settings.default_data_dir({"XDG_DATA_HOME": "/data/ana"}, 0) == Path("/var/lib/oncegate")
    loaded = settings.load({"upstream": UPSTREAM}, {"XDG_DATA_HOME": "/data/ana"}, None)
    assert loaded.data_dir == settings.default_data_dir({"XDG_DATA_HOME": "/data/ana"})


def _config_error(flags: dict[str, str], path: Path | None = None) -> str:
    with pytest.raises(errors.ConfigError) as raised:
        settings.load(flags, {}, path)
    return str(raised.value)


def test_methods_may_be_one_word_and_a_wrong_type_says_what_is_expected(tmp_path: Path) -> None:
    path = tmp_path / "oncegate.yaml"
    path.write_text("routes:\n  - {name: a, match: /, upstream: 'http://x', methods: post}\n")
    assert settings.load({}, {}, path).routes[0].methods == frozenset({"POST"})
    path.write_text("routes:\n  - {name: a, match: /, upstream: 'http://x', methods: 5}\n")
    assert _config_error({}, path) == (
        f"invalid configuration in {path}:\n"
        "  routes[0].methods: a list of HTTP methods, like [POST, PATCH], not 5"
    )


def test_a_bad_upstream_flag_is_said_once() -> None:
    assert _config_error({"upstream": "127.0.0.1:9000"}) == (
        "invalid configuration:\n"
        "  upstream: '127.0.0.1:9000' is not an http:// or https:// URL with a host"
    )


def test_a_short_ttl_flag_blames_the_route_the_flag_adds_and_says_only_a_file_changes_it() -> None:
    assert _config_error({"upstream": UPSTREAM, "ttl": "30s"}) == (
        "invalid configuration:\n"
        "  the route 'default' that upstream (--upstream) adds: ttl (30s) must exceed lease "
        "(60s, twice the timeout): a key cannot expire while its request is still in flight; "
        "that route has the default timeout (30s) and lease (twice it), which only a config "
        "file can change (routes: with its own timeout or lease): give a longer ttl, or write "
        "the route in a file"
    )


def test_a_bad_ttl_flag_is_said_once(tmp_path: Path) -> None:
    assert _config_error({"upstream": UPSTREAM, "ttl": "1week"}) == (
        "invalid configuration:\n"
        "  ttl: '1week' is not a duration: use a number of seconds or 90s, 15m, 24h, 7d"
    )
    # Nor again for each route of a file that takes it.
    path = tmp_path / "oncegate.yaml"
    path.write_text("ttl: 1week\nroutes:\n  - {name: a, match: /, upstream: 'http://x'}\n")
    assert _config_error({}, path) == (
        f"invalid configuration in {path}:\n"
        "  ttl: '1week' is not a duration: use a number of seconds or 90s, 15m, 24h, 7d"
    )


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "oncegate.yaml"
    path.write_text("routes:\n  - name: a\n    match: /\n   upstream: x\n")
    assert _config_error({}, path) == (
        f"{path}, line 4, column 4: not valid YAML: expected <block end>, but found "
        "'<block mapping start>' (while parsing a block collection)"
    )


# -- where the key is, and waiting (contract section 10) ------------------------------------


def test_the_key_is_in_idempotency_key_unless_the_route_says_otherwise() -> None:
    assert route().key_header_name == "idempotency-key" and route().key_pointer is None
    assert route(key_header="PayPal-Request-Id").key_header_name == "paypal-request-id"
    assert route(key_from_body="/a~1b/0").key_pointer == ("a/b", "0")


@pytest.mark.parametrize(
    "name",
    ["Connection", "keep-alive", "TE", "Transfer-Encoding", "Upgrade", "Content-Length",
     "Proxy-Authorization", "Host", "Expect", "Content-Type", "Authorization", "Cookie",
     "Prefer", "X-Request-Id", "traceparent"],
)  # fmt: skip
def test_a_key_header_the_upstream_would_not_get_as_sent_is_refused(
    tmp_path: Path, name: str
) -> None:
    message = load_error(
        tmp_path, f"routes: [{{name: r, match: /, upstream: {UPSTREAM}, key_header: {name}}}]"
    )
    assert f"routes[0].key_header: {name!r}" in message


@pytest.mark.parametrize("name", ["Pay Pal", "a:b", "", "é", "x-key\n"])
def test_a_key_header_that_is_no_header_name_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not a header name"):
        route(key_header=name)


@pytest.mark.parametrize(
    "fields",
    [{"name": "payments\n"}, {"methods": ["POST\n"]}, {"scope_headers": ["authorization\n"]}],
)
def test_a_name_with_a_newline_after_it_is_refused(fields: dict[str, object]) -> None:
    """A pattern's `$` matches before a final newline too: every name is matched whole."""
    with pytest.raises(ValueError, match=r"not an? |a route name is"):
        route(**fields)


def test_a_key_header_that_is_a_scope_header_is_refused() -> None:
    with pytest.raises(ValueError, match="scope header"):
        route(key_header="X-Tenant", scope_headers=["x-tenant"])


def test_key_header_and_key_from_body_on_one_route_are_refused(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        f"routes: [{{name: r, match: /, upstream: {UPSTREAM}, key_header: X-Idempotency-Key,"
        " key_from_body: /idempotency_key}]",
    )
    assert "key_header and key_from_body" in message


@pytest.mark.parametrize("pointer", ["idempotency_key", "''", "/a~2"])
def test_a_malformed_key_pointer_is_refused(tmp_path: Path, pointer: str) -> None:
    message = load_error(
        tmp_path, f"routes: [{{name: r, match: /, upstream: {UPSTREAM}, key_from_body: {pointer}}}]"
    )
    assert "routes[0].key_from_body:" in message and "pointer" in message


def test_wait_is_a_duration_of_zero_by_default_and_at_most_max_wait() -> None:
    assert route().wait == 0
    assert route(wait="2s").wait == 2.0
    assert route(wait="15s", max_wait="20s").wait == 15.0
    with pytest.raises(ValueError, match="max_wait"):
        route(wait="15s")
    with pytest.raises(ValueError):
        route(wait="-1s")


def test_the_waiter_bounds_are_settings(tmp_path: Path) -> None:
    loaded = settings.load({"upstream": UPSTREAM}, {"ONCEGATE_MAX_WAITERS": "10"})
    assert loaded.max_waiters == 10 and loaded.max_waiters_per_key == 64
    assert "max_waiters_per_key" in load_error(
        tmp_path, "max_waiters_per_key: -1", flags={"upstream": UPSTREAM}
    )


def test_the_otel_variables_tracing_reads_are_read_and_checked_at_load() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
        "OTEL_SERVICE_NAME": "gateway-eu",
        "OTEL_RESOURCE_ATTRIBUTES": "the SDK's own",
    }
    loaded = settings.load({"upstream": UPSTREAM}, environ, None)
    assert loaded.otel_variables == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
        "OTEL_SERVICE_NAME": "gateway-eu",
    }
    with pytest.raises(errors.ConfigError, match="OTEL_BSP_SCHEDULE_DELAY is milliseconds"):
        settings.load({"upstream": UPSTREAM}, {**environ, "OTEL_BSP_SCHEDULE_DELAY": "soon"}, None)


def test_the_store_options_have_one_set_of_defaults_and_follow_the_variables() -> None:
    assert settings.StoreSettings().store_options() == settings.StoreOptions()
    assert settings.load({"upstream": UPSTREAM}, {}, None).store_options() == (
        settings.StoreOptions()
    )
    # What purge and rekey open: one connection, with the operator's timeouts and commit setting.
    environ = {"ONCEGATE_STORE_COMMAND_TIMEOUT": "3s", "ONCEGATE_STORE_ANSWER_COMMIT": "on"}
    options = settings.load_part(settings.StoreSettings, environ).store_options(pool_size=1)
    assert (options.pool_size, options.command_timeout, options.answer_commit) == (1, 3.0, "on")


# -- workers ------------------------------------------------------------------------------------


@pytest.fixture
def four_cpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This process may run on 4 CPUs, under a cgroup directory the test writes (none yet)."""
    monkeypatch.setattr(units.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    monkeypatch.setattr(units, "CGROUP", cgroup)
    return cgroup


def test_workers_auto_is_one_per_cpu_the_process_may_use(four_cpus: Path, tmp_path: Path) -> None:
    assert settings.load({"workers": "auto", "upstream": UPSTREAM}, {}).workers == 4
    assert settings.load({"upstream": UPSTREAM}, {"ONCEGATE_WORKERS": "AUTO"}).workers == 4
    path = write(tmp_path, f"upstream: {UPSTREAM}\nworkers: auto\n")
    assert settings.load({}, {}, path).workers == 4
    assert settings.load({"workers": "3", "upstream": UPSTREAM}, {}).workers == 3
    assert settings.load({"upstream": UPSTREAM}, {}).workers == 1


@pytest.mark.parametrize(
    ("v2", "v1", "cores"),
    [
        ("250000 100000", None, 2),  # 2.5 CPUs: the third worker would be throttled
        ("50000 100000", None, 1),  # half a CPU: still one worker
        ("max 100000", None, 4),  # no quota
        ("800000 100000", None, 4),  # more quota than CPUs: the CPUs
        (None, ("300000", "100000"), 3),  # cgroup v1
        (None, ("-1", "100000"), 4),  # cgroup v1 without a quota
        ("garbage", None, 4),  # unreadable: the CPUs
    ],
)
def test_workers_auto_heeds_a_cpu_quota(
    four_cpus: Path, v2: str | None, v1: tuple[str, str] | None, cores: int
) -> None:
    if v2 is not None:
        (four_cpus / "cpu.max").write_text(v2 + "\n")
    if v1 is not None:
        (four_cpus / "cpu").mkdir()
        (four_cpus / "cpu" / "cpu.cfs_quota_us").write_text(v1[0] + "\n")
        (four_cpus / "cpu" / "cpu.cfs_period_us").write_text(v1[1] + "\n")
    assert settings.load({"workers": "auto", "upstream": UPSTREAM}, {}).workers == cores


def test_workers_auto_is_at_most_the_limit(
    monkeypatch: pytest.MonkeyPatch, four_cpus: Path
) -> None:
    monkeypatch.setattr(units.os, "sched_getaffinity", lambda pid: set(range(200)))
    assert settings.load({"workers": "auto", "upstream": UPSTREAM}, {}).workers == 64


@pytest.mark.parametrize("workers", ["0", "65", "two", "1.5", 2.0, True])
def test_workers_that_are_not_a_count_are_refused(tmp_path: Path, workers: object) -> None:
    message = load_error(tmp_path, flags={"workers": workers, "upstream": UPSTREAM})
    assert "workers" in message
