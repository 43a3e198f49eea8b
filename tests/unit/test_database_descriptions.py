"""What the logs say about a database: where it is (one host or a host list), never its password;
and which URLs are refused at start-up, with a sentence instead of a traceback."""

from __future__ import annotations

import re

import pytest

from oncegate.settings import database_url
from oncegate.settings.database_url import Host


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://ana:s3cret@db:5432/oncegate", "postgresql://ana@db:5432/oncegate"),
        ("postgresql://ana@db/oncegate", "postgresql://ana@db/oncegate"),
        ("postgresql://db/oncegate?password=s3cret&sslmode=require",
         "postgresql://db/oncegate?sslmode=require"),
        ("postgres://ana:p%40ss@[::1]:5433/x", "postgres://ana@[::1]:5433/x"),
        ("postgresql://ana:s3cret@h1:5432,h2:5433/db?target_session_attrs=read-write",
         "postgresql://ana@h1:5432,h2:5433/db?target_session_attrs=read-write"),
        ("postgresql://ana:s3cret@/db?host=h1:5432,h2:5433&password=x&target_session_attrs=primary",
         "postgresql://ana@/db?host=h1:5432,h2:5433&target_session_attrs=primary"),
        # The client key's passphrase is a secret too (libpq's and asyncpg's sslpassword).
        ("postgresql://ana@db/x?sslmode=verify-full&sslkey=/k.pem&sslpassword=s3cret",
         "postgresql://ana@db/x?sslmode=verify-full&sslkey=/k.pem"),
    ],
)  # fmt: skip
def test_a_url_in_the_log_has_no_password(url: str, shown: str) -> None:
    assert database_url.without_password(url) == shown


@pytest.mark.parametrize(
    ("url", "described"),
    [
        ("postgresql://ana:s3cret@db:6432/oncegate", "db:6432, database oncegate"),
        ("postgresql://postgres:@/postgres?host=/srv/pg",
         "the Unix socket in /srv/pg, database postgres"),
        ("postgresql://db", "db:5432, database (default database)"),
        ("postgresql://u:pw@[::1]:5433/x", "[::1]:5433, database x"),
        ("postgresql://u:pw@127.0.0.1:5432,127.0.0.1:5433/db?target_session_attrs=read-write",
         "hosts 127.0.0.1:5432, 127.0.0.1:5433 (read-write), database db"),
        ("postgresql://u:pw@/db?host=h1:6000,h2&target_session_attrs=read-write",
         "hosts h1:6000, h2:5432 (read-write), database db"),
        ("postgresql://u@/db?host=h1,h2&port=6000,6001&target_session_attrs=primary",
         "hosts h1:6000, h2:6001 (primary), database db"),
        ("postgresql://u@/db?host=h1,h2&port=6000&target_session_attrs=read-write",
         "hosts h1:6000, h2:6000 (read-write), database db"),
    ],
)  # fmt: skip
def test_a_url_is_described_as_its_hosts_and_database(url: str, described: str) -> None:
    assert database_url.describe(url) == described
    assert "pw" not in described and "s3cret" not in described


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://db/x", "postgresql:// URL"),
        ("postgresql://u@h1:5432,h2:5433/db", "needs target_session_attrs=read-write"),
        ("postgresql://u@h1,h2/db?target_session_attrs=any", "needs target_session_attrs"),
        ("postgresql://u@db/x?target_session_attrs=standby", "settle on a standby"),
        ("postgresql://u@db/x?target_session_attrs=sideways", "is not one of"),
        ("postgresql://u@db/x?sslmode=bogus", "sslmode is not one of disable, allow, prefer"),
        ("postgresql://u@db/x?sslmode=Require", "sslmode is not one of"),
        ("postgresql://u@db:port/x", "not a number"),
        ("postgresql://u@db:70000/x", "not a number"),
        ("postgresql://u@h1,,h2/x?target_session_attrs=read-write", "empty entry"),
        ("postgresql://u@/x?host=h1&host=h2", "host= twice"),
        ("postgresql://u@h0/x?host=h1", "names hosts twice"),
        ("postgresql://u@/x?host=h1,h2,h3&port=1,2&target_session_attrs=read-write",
         "3 hosts and 2 ports"),
        ("postgresql://u@/x?host=h1:1,h2&port=2&target_session_attrs=read-write",
         "beside its hosts and in port="),
    ],
)  # fmt: skip
def test_a_url_that_cannot_work_is_refused_with_a_sentence(url: str, says: str) -> None:
    with pytest.raises(database_url.InvalidDatabaseUrl, match=says):
        database_url.parse(url)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:hunter2@db:99999/x",
        # A password with '/', '?' or '#' not percent-encoded (base64 has '/'): the URL's
        # authority ends inside it, so its first part reads as a host and a port.
        "postgresql://u:hunter2/more@db/x",
        "postgresql://u:hunter2?more@db/x",
        "postgresql://u:hunter2#more@db/x",
        "postgresql://u:1234/hunter2@db/x",  # read as host u, port 1234, database hunter2@db/x
        # A '?' whose rest reads as a query (`x=tail9@db/x`): host u, port hunter2.
        "postgresql://u:hunter2?x=tail9@db/x",
        "postgresql://u:hunter2?x=tail9@db",
        # An '@' in the password: asyncpg and libpq end it at the first '@' and take
        # `tail9@db` for the host.
        "postgresql://u:hunter2@tail9@db/x",
        "postgresql://u:hunter2@tail9@db:5432,db2:5432/x?target_session_attrs=read-write",
        # No '@' and no host at all: the password reads as the port, the user as the host.
        "postgresql://u:hunter2/tail9",
        "postgresql://u:hunter2tail9",
    ],
)
def test_a_refusal_never_repeats_the_password(url: str) -> None:
    with pytest.raises(database_url.InvalidDatabaseUrl) as refused:
        database_url.parse(url)
    said = str(refused.value)
    assert "hunter2" not in said and "more" not in said.replace("more than", "")
    assert "tail9" not in said


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://u:a?x=b@db/x", "percent-encode '/', '?' and '#' in the password"),
        ("postgresql://u:a@b@db/x", "percent-encode '@' in the user name or password"),
        ("postgresql://u:ab/x", "a password goes before an '@' and the host"),
    ],
)
def test_a_password_that_would_be_misread_says_how_to_write_it(url: str, says: str) -> None:
    with pytest.raises(database_url.InvalidDatabaseUrl, match=re.escape(says)):
        database_url.parse(url)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:a%3Fx%3Db@db/x",
        "postgresql://u:a%40b@db/x",
        "postgresql://u:a%2Fb%23c@db/x",
        "postgresql://u:a:b@db/x",  # a ':' after the first is the password's
        "postgresql://u@db/x?sslmode=require&application_name=a%40b",
    ],
)
def test_the_same_passwords_percent_encoded_are_read(url: str) -> None:
    assert database_url.parse(url).describe() == "db:5432, database x"


def test_a_password_that_ends_the_authority_is_said_to_need_percent_encoding() -> None:
    with pytest.raises(database_url.InvalidDatabaseUrl, match="percent-encode"):
        database_url.parse("postgresql://u:a/b@db/x")
    # Percent-encoded, the same password is read.
    assert database_url.parse("postgresql://u:a%2Fb@db/x").describe() == "db:5432, database x"


def test_the_host_a_connection_reached_is_named_as_the_url_names_it() -> None:
    url = database_url.parse(
        "postgresql://u@/db?host=127.0.0.1:5432,/run/pg&target_session_attrs=read-write"
    )
    assert url.host_at(("127.0.0.1", 5432)) == Host("127.0.0.1", 5432)
    assert str(url.host_at("/run/pg/.s.PGSQL.5432")) == "the Unix socket in /run/pg"
    assert str(url.host_at(("10.0.0.9", 6000))) == "10.0.0.9:6000"  # not in the list: as reached
    assert url.host_at(None) is None


@pytest.mark.parametrize(
    ("url", "for_libpq"),
    [
        ("postgresql://u:pw@/db?host=h1:5432,h2:5433&target_session_attrs=read-write",
         "postgresql://u:pw@/db?host=h1,h2&port=5432,5433&target_session_attrs=read-write"),
        ("postgresql://u@/db?host=127.0.0.1:6000,/run/pg&target_session_attrs=read-write",
         "postgresql://u@/db?host=127.0.0.1,/run/pg&port=6000,5432&target_session_attrs=read-write"),
        ("postgresql://u@h1:5432,h2:5433/db?target_session_attrs=read-write",
         "postgresql://u@h1:5432,h2:5433/db?target_session_attrs=read-write"),
        ("postgresql://u@/db?host=h1,h2&port=1,2&target_session_attrs=read-write",
         "postgresql://u@/db?host=h1,h2&port=1,2&target_session_attrs=read-write"),
        ("postgresql://u@db/x", "postgresql://u@db/x"),
    ],
)  # fmt: skip
def test_a_host_list_is_given_to_libpq_in_the_form_it_reads(url: str, for_libpq: str) -> None:
    assert database_url.for_libpq(url) == for_libpq
    assert database_url.parse(for_libpq).hosts == database_url.parse(url).hosts
