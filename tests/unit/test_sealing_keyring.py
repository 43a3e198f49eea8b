"""oncegate.kernel.sealing: AES-256-GCM under named keys, bound to the claim (contract
section 9)."""

from __future__ import annotations

import base64
import os

import pytest

from oncegate.kernel import sealing
from oncegate.kernel.sealing import Keyring, Unopenable
from oncegate.model import errors
from oncegate.model.answers import SealedAnswer, SealedRequest

SCOPE = b"s" * 32
HEADERS = [("content-type", "application/json"), ("location", "/charges/ch_1")]
BODY = b'{"id": "ch_1", "card": "4242"}'


def key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def keyring(*names: str) -> Keyring:
    return Keyring.parse(",".join(f"{name}:{key()}" for name in names))


def test_a_sealed_answer_opens_to_what_was_sealed_and_holds_no_plaintext() -> None:
    ring = keyring("k1")
    sealed = ring.seal((7, 1), SCOPE, HEADERS, BODY)
    assert sealed.key_name == "k1:2"  # the key, and the claim binding
    assert sealed.body is not None and b"4242" not in sealed.body
    assert b"ch_1" not in sealed.headers and b"location" not in sealed.headers
    assert ring.open((7, 1), SCOPE, sealed) == (HEADERS, BODY)


def test_the_headers_of_an_answer_too_large_to_store_are_sealed_alone() -> None:
    old_text, new_text = f"k1:{key()}", f"k2:{key()}"
    ring, both = Keyring.parse(old_text), Keyring.parse(f"{new_text},{old_text}")
    sealed = ring.seal((7, 1), SCOPE, HEADERS, None)
    assert sealed.body is None and b"location" not in sealed.headers
    assert ring.open((7, 1), SCOPE, sealed) == (HEADERS, None)
    with pytest.raises(Unopenable):
        ring.open((7, 2), SCOPE, sealed)  # written back after its key was claimed again
    resealed = both.reseal((7, 1), SCOPE, sealed)  # `oncegate rekey`
    assert (resealed.key_name, resealed.body) == ("k2:2", None)
    assert both.open((7, 1), SCOPE, resealed) == (HEADERS, None)
    plain = sealing.plaintext(HEADERS, None)
    assert sealing.open_plain(plain) == (HEADERS, None)


def test_the_first_key_seals_and_every_key_opens() -> None:
    old_text, new_text = f"k1:{key()}", f"k2:{key()}"
    old = Keyring.parse(old_text)
    sealed_old = old.seal((1, 1), SCOPE, HEADERS, BODY)
    rotated = Keyring.parse(f"{new_text},{old_text}")
    assert rotated.seal((1, 1), SCOPE, HEADERS, BODY).key_name == "k2:2"
    assert rotated.open((1, 1), SCOPE, sealed_old) == (HEADERS, BODY)
    with pytest.raises(Unopenable, match="does not hold") as refused:
        Keyring.parse(new_text).open((1, 1), SCOPE, sealed_old)
    assert refused.value.key_name == "k1"


@pytest.mark.parametrize(
    "moved",
    [
        lambda sealed: ((8, 1), SCOPE, sealed),  # another row
        lambda sealed: ((7, 2), SCOPE, sealed),  # its row, claimed again (reclaim, take-over)
        lambda sealed: ((7, 1), b"t" * 32, sealed),  # another scope
        lambda sealed: ((7, 1), SCOPE, SealedAnswer("k1:2", sealed.body, sealed.headers)),
        lambda sealed: ((7, 1), SCOPE, SealedAnswer("k1:2", sealed.headers, _flip(sealed.body))),
        lambda sealed: ((7, 1), SCOPE, SealedAnswer("k1:2", _flip(sealed.headers), sealed.body)),
    ],
    ids=["row", "claim", "scope", "swapped-columns", "body-byte", "headers-byte"],
)
def test_a_sealed_answer_moved_or_changed_does_not_open(moved: object) -> None:
    ring = keyring("k1")
    sealed = ring.seal((7, 1), SCOPE, HEADERS, BODY)
    claim, scope, stored = moved(sealed)  # type: ignore[operator]
    with pytest.raises(Unopenable, match="does not open"):
        ring.open(claim, scope, stored)


def _flip(data: bytes | None) -> bytes:
    assert data is not None
    return data[:20] + bytes([data[20] ^ 1]) + data[21:]


def test_plaintext_answers_open_without_a_keyring_and_sealed_ones_do_not() -> None:
    assert sealing.open_plain(sealing.plaintext(HEADERS, BODY)) == (HEADERS, BODY)
    with pytest.raises(Unopenable, match="not set"):
        sealing.open_plain(keyring("k1").seal((1, 1), SCOPE, HEADERS, BODY))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("k1", "name:base64-key"),
        ("k1:not base64!", "not base64"),
        (f"k1:{base64.b64encode(os.urandom(16)).decode()}", "16 bytes; AES-256 needs 32"),
        (f"k1:{key()},k1:{key()}", "given twice"),
        (f"bad name:{key()}", "name:base64-key"),
    ],
    # Named, not by their random keys: every worker of a parallel run collects the same tests.
    ids=["no-key", "not-base64", "16-bytes", "given-twice", "bad-name"],
)
def test_a_bad_keyring_is_refused_without_showing_key_material(text: str, message: str) -> None:
    with pytest.raises(errors.ConfigError, match=message) as refused:
        Keyring.parse(text)
    secret = text.rpartition(":")[2]
    assert len(secret) < 8 or secret not in str(refused.value)


@pytest.mark.parametrize("kept", [0, 5, 11, 12, 27])
@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_sealed_value_cut_short_is_unopenable_whatever_its_length(part: str, kept: int) -> None:
    ring = keyring("k1")
    sealed = ring.seal((7, 1), SCOPE, HEADERS, BODY)
    assert sealed.body is not None
    if part == "headers":
        cut = SealedAnswer(sealed.key_name, sealed.headers[:kept], sealed.body)
    else:
        cut = SealedAnswer(sealed.key_name, sealed.headers, sealed.body[:kept])
    with pytest.raises(Unopenable):
        ring.open((7, 1), SCOPE, cut)
    with pytest.raises(Unopenable):
        ring.reseal((7, 1), SCOPE, cut)


@pytest.mark.parametrize("stored", [b'[["a", "b"', b"[1]", b'[["a", "b", "c"]]', b'[["a", 1]]'])
def test_plaintext_headers_that_are_not_their_json_are_unopenable(stored: bytes) -> None:
    with pytest.raises(Unopenable):
        sealing.open_plain(SealedAnswer(None, stored, b"body"))


def row_bound(ring: Keyring, name: str, record_id: int) -> SealedAnswer:
    """An answer as releases before the claim binding sealed it: bound to its row alone."""
    cipher = ring._ciphers[name]
    headers = sealing._seal(cipher, sealing._headers_json(HEADERS),
                            sealing._row_bound(record_id, SCOPE, b"headers"))  # fmt: skip
    body = sealing._seal(cipher, BODY, sealing._row_bound(record_id, SCOPE, b"body"))
    return SealedAnswer(name, headers, body)


def test_an_answer_of_an_earlier_release_opens_only_for_rekey_which_binds_it_to_its_claim() -> None:
    ring = keyring("k1")
    old = row_bound(ring, "k1", 7)
    # A gateway refuses it: under the row binding, any claim of the row would open it.
    for token in (1, 2):
        with pytest.raises(Unopenable, match="oncegate rekey"):
            ring.open((7, token), SCOPE, old)
    # rekey opens it under the row binding and seals it for the row's claim now.
    resealed = ring.reseal((7, 3), SCOPE, old)
    assert resealed.key_name == "k1:2"
    assert ring.open((7, 3), SCOPE, resealed) == (HEADERS, BODY)
    with pytest.raises(Unopenable, match="does not open"):
        ring.open((7, 4), SCOPE, resealed)  # and for that claim alone
    # Nor does a gateway open it when sealed_with is rewritten to claim the new binding.
    with pytest.raises(Unopenable, match="does not open"):
        ring.open((7, 1), SCOPE, SealedAnswer("k1:2", old.headers, old.body))


def test_a_kept_request_opens_for_its_scope_key_and_fingerprint_alone() -> None:
    ring, fingerprint = keyring("k1"), b"f" * 32
    sealed = ring.seal_request(SCOPE, "k-81", fingerprint, b"POST /charges amount=5")
    assert sealed.key_name == "k1:f"
    assert ring.open_request(SCOPE, "k-81", fingerprint, sealed) == b"POST /charges amount=5"
    for scope, key, other in ((b"t" * 32, "k-81", fingerprint), (SCOPE, "k-82", fingerprint),
                              (SCOPE, "k-81", b"g" * 32)):  # fmt: skip
        with pytest.raises(Unopenable):
            ring.open_request(scope, key, other, sealed)


def test_a_kept_request_of_an_earlier_release_opens_and_rekey_binds_its_fingerprint() -> None:
    # Releases before bound a kept request to its scope and key alone, `request_sealed_with`
    # the key's name: it opens as it was sealed (it lives only until its key settles) and
    # rekey re-seals it under the fingerprint binding.
    ring, fingerprint = keyring("k1"), b"f" * 32
    bound = sealing._request_bound(SCOPE, "k-81")
    earlier = SealedRequest("k1", sealing._seal(ring._ciphers["k1"], b"amount=5", bound))
    assert ring.open_request(SCOPE, "k-81", fingerprint, earlier) == b"amount=5"
    resealed = ring.reseal_request(SCOPE, "k-81", fingerprint, earlier)
    assert resealed.key_name == "k1:f"
    assert ring.open_request(SCOPE, "k-81", fingerprint, resealed) == b"amount=5"
    with pytest.raises(Unopenable):
        ring.open_request(SCOPE, "k-81", b"g" * 32, resealed)
    with pytest.raises(Unopenable, match="does not know"):
        ring.open_request(SCOPE, "k-81", fingerprint, SealedRequest("k1:9", resealed.data))
