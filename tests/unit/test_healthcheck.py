"""The image's health check probes the admin port the gateway was given."""

from __future__ import annotations

from oncegate.commands.healthcheck import health_url


def test_the_flag_wins_over_the_variable_and_the_default() -> None:
    serve = ["/usr/local/bin/python", "/usr/local/bin/oncegate", "serve", "--host", "0.0.0.0"]
    assert health_url(serve, {}) == "http://127.0.0.1:8081/healthz"
    assert health_url(serve, {"ONCEGATE_ADMIN_PORT": "9102"}) == "http://127.0.0.1:9102/healthz"
    flagged = [*serve, "--admin-port", "9101"]
    assert health_url(flagged, {"ONCEGATE_ADMIN_PORT": "9102"}) == "http://127.0.0.1:9101/healthz"
    assert health_url([*serve, "--admin-port=9103"], {}) == "http://127.0.0.1:9103/healthz"


def test_a_specific_address_is_probed_there() -> None:
    assert health_url(["serve", "--host", "10.1.2.3"], {}) == "http://10.1.2.3:8081/healthz"
    assert health_url(["serve", "--host", "::1"], {}) == "http://[::1]:8081/healthz"
    assert health_url(["serve", "--host", "::"], {}) == "http://127.0.0.1:8081/healthz"
