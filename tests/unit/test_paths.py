"""oncegate.kernel.paths: the normal form of a request path (contract section 3, RFC 3986
§6.2.2)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oncegate.kernel import paths
from oncegate.model import errors


@pytest.mark.parametrize(
    ("given_path", "normal"),
    [
        ("/emails", "/emails"),
        ("/%65mails", "/emails"),  # an unreserved character, escaped
        ("/%7Eana/%2d%5F", "/~ana/-_"),
        ("/./emails", "/emails"),
        ("/x/../emails", "/emails"),
        ("/payments/../emails", "/emails"),
        ("/a/%2e%2E/b", "/b"),  # escaped dots are dots
        ("//emails", "/emails"),  # merged, as nginx does
        ("/a//b///c/", "/a/b/c/"),
        ("/a/b/.", "/a/b/"),
        ("/a/b/..", "/a/"),
        ("/a/..", "/"),
        ("/.", "/"),
        ("/", "/"),
        ("/a/%2fb", "/a/%2Fb"),  # a reserved escape stays, its hex upper-cased
        ("/caf%c3%a9", "/caf%C3%A9"),
        ("/a.b/c..d/...", "/a.b/c..d/..."),  # dots inside a segment are not dot segments
    ],
)
def test_normal_forms(given_path: str, normal: str) -> None:
    assert paths.normalize(given_path) == normal


@pytest.mark.parametrize(
    "given_path", ["/..", "/../etc/passwd", "/based/../../admin/secret", "/a/%2E%2E/%2e%2e/b"]
)
def test_a_path_that_climbs_above_the_root_is_refused(given_path: str) -> None:
    with pytest.raises(errors.InvalidPath, match="climbs above"):
        paths.normalize(given_path)


@pytest.mark.parametrize("given_path", ["/%zz", "/a%4", "/%", "/%g0"])
def test_a_broken_escape_is_refused(given_path: str) -> None:
    with pytest.raises(errors.InvalidPath, match="broken percent escape"):
        paths.normalize(given_path)


@pytest.mark.parametrize("given_path", ["*", "emails", ""])
def test_a_path_must_start_with_a_slash(given_path: str) -> None:
    with pytest.raises(errors.InvalidPath, match="must start with"):
        paths.normalize(given_path)


segment = st.one_of(
    st.sampled_from([".", "..", "", "%2e", "%2E%2e", "%41", "%2f", "%7e", "a", "b.c"]),
    st.text(alphabet="abcXYZ019-._~%2Ef", min_size=1, max_size=6),
)


@given(st.lists(segment, max_size=8))
def test_the_normal_form_is_normal(segments: list[str]) -> None:
    try:
        normal = paths.normalize("/" + "/".join(segments))
    except errors.InvalidPath:
        return
    assert paths.normalize(normal) == normal  # idempotent
    assert "//" not in normal
    parts = normal.split("/")
    assert "." not in parts and ".." not in parts


@pytest.mark.parametrize(
    ("given_path", "slashed"),
    [
        ("/files/a%2Fb", "/files/a/b"),
        ("/a%5Cb", "/a/b"),
        ("/plain/path", None),
    ],
)
def test_encoded_slashes_read_as_slashes(given_path: str, slashed: str | None) -> None:
    assert paths.as_slashes(paths.normalize(given_path)) == slashed


@pytest.mark.parametrize("given_path", ["/x%2F..%2Fpayments/charges", "/a%5C.%5Cb", "/%2f.."])
def test_a_dot_segment_behind_encoded_slashes_is_refused(given_path: str) -> None:
    with pytest.raises(errors.InvalidPath, match="behind percent-encoded slashes"):
        paths.as_slashes(paths.normalize(given_path))
