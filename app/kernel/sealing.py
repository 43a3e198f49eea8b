"""Sealing stored answers: AES-256-GCM, under named keys (`ONCEGATE_ENCRYPTION_KEYS`).

Stored bodies and headers of a payment API are card and personal data. With a keyring, every
answer is sealed before it reaches the database, and nothing of it is there in plaintext but
its status:

- `ONCEGATE_ENCRYPTION_KEYS` is `name:base64,name:base64,...`, each key 32 random bytes. The first
  seals; every one opens, so a key is rotated by putting a new one first and retired after
  `oncegate rekey` has re-sealed the rows under the new one.
- A sealed value is a 12-byte random nonce and the ciphertext with its tag. The key's name is
  stored beside it, and the claim that stored it, its scope and which part it is (headers or
  body) are bound as associated data: a sealed answer moved to another row, another scope or the
  other column does not open, nor one written back into its own row after the key was claimed
  again. The claim is the row's id and its fencing token, which every reclaim of an expired key,
  take-over and operator's resolution raises (an operator's answer is bound to the token its
  resolution gives the row).
- `sealed_with` holds the key's name and the binding (`k1:2`). Answers sealed before answers were
  bound to their claim (`k1`: row, scope and part only) are not opened by a gateway: an old answer
  written back into a row claimed again would open under that binding. Their retries get 503
  `answer-sealed` (never forwarded again) until `oncegate rekey` re-seals them under the claim
  binding: rekey alone opens the row binding, and it counts them as not yet under the newest key.
- A value that does not open (its key is not configured, it was changed, or cut short below a
  nonce and a tag; stored headers that are not their JSON) raises `Unopenable`: the gateway
  answers 503 `answer-sealed` and never forwards the request again, since it was performed, and
  `oncegate rekey` names the row and goes on.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
import re
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..model import errors, jsontext
from ..model.answers import SealedAnswer, SealedRequest

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}\Z")
# The associated data's version, after the key's name in `sealed_with`: 2 binds the claim (row id
# and fencing token); a name alone is the row binding of earlier releases.
CLAIM_BINDING = "2"
# The same for kept requests, in `request_sealed_with`: `f` binds the request's fingerprint (with
# its scope and key), so a kept request of an earlier claim of the key written back into the row
# does not open unless it is the same request; a name alone binds scope and key, as releases
# before did.
REQUEST_BINDING = "f"
_NONCE_BYTES = 12  # the size GCM is designed for; random per value, never reused in practice
_TAG_BYTES = 16  # GCM's tag, after the ciphertext
KEY_BYTES = 32
# The claim an answer belongs to: its row's id and the fencing token the row had when the answer
# was stored.
Claimed = tuple[int, int]


class Unopenable(Exception):
    """A sealed value that cannot be opened: its key is not configured, or it was changed."""

    def __init__(self, message: str, key_name: str) -> None:
        super().__init__(message)
        self.key_name = key_name


class Keyring:
    def __init__(self, keys: Sequence[tuple[str, bytes]]) -> None:
        if not keys:
            raise ValueError("a keyring needs at least one key")
        self.current = keys[0][0]
        self._ciphers = {name: AESGCM(key) for name, key in keys}

    @classmethod
    def parse(cls, text: str) -> Keyring:
        """`name:base64,...`, checked whole; the message never holds key material."""
        keys: list[tuple[str, bytes]] = []
        for position, entry in enumerate(part.strip() for part in text.split(",")):
            name, separator, encoded = entry.partition(":")
            where = f"ONCEGATE_ENCRYPTION_KEYS entry {position + 1}"
            if not separator or not _NAME.match(name):
                raise errors.ConfigError(
                    f"{where}: give name:base64-key, the name 1-32 letters, digits, '.', '_' or '-'"
                )
            try:
                key = base64.b64decode(encoded, validate=True)
            except binascii.Error:
                raise errors.ConfigError(f"{where} ({name}): the key is not base64") from None
            if len(key) != KEY_BYTES:
                raise errors.ConfigError(
                    f"{where} ({name}): the key is {len(key)} bytes; AES-256 needs {KEY_BYTES} "
                    f"(make one with: python -c 'import os, base64; "
                    f"print(base64.b64encode(os.urandom({KEY_BYTES})).decode())')"
                )
            if any(name == known for known, _ in keys):
                raise errors.ConfigError(f"{where}: the name {name!r} is given twice")
            keys.append((name, key))
        return cls(keys)

    @property
    def sealed_with(self) -> str:
        """What new answers' `sealed_with` says: the newest key, and the claim binding."""
        return f"{self.current}:{CLAIM_BINDING}"

    def seal(self, claim: Claimed, scope: bytes, headers: Sequence[tuple[str, str]],
             body: bytes | None) -> SealedAnswer:  # fmt: skip
        """`body` None: an answer too large to store, its headers alone (`SealedAnswer`)."""
        cipher = self._ciphers[self.current]
        return SealedAnswer(
            key_name=self.sealed_with,
            headers=_seal(cipher, _headers_json(headers), _bound(claim, scope, b"headers")),
            body=None if body is None else _seal(cipher, body, _bound(claim, scope, b"body")),
        )

    def open(
        self, claim: Claimed, scope: bytes, stored: SealedAnswer, *, row_binding: bool = False
    ) -> tuple[list[tuple[str, str]], bytes | None]:
        """The headers and body of a stored answer, sealed or not (the body None when it was too
        large to store). `row_binding`: also open an answer sealed before answers were bound to
        their claim (`oncegate rekey` alone)."""
        if stored.key_name is None:
            return header_pairs(stored.headers), stored.body
        name, _, binding = stored.key_name.partition(":")
        cipher = self._ciphers.get(name)
        if cipher is None:
            raise Unopenable(
                f"sealed with key {name!r}, which ONCEGATE_ENCRYPTION_KEYS does not hold", name
            )
        if binding == CLAIM_BINDING:
            bound = functools.partial(_bound, claim, scope)
        elif binding == "" and row_binding:
            bound = functools.partial(_row_bound, claim[0], scope)
        elif binding == "":
            raise Unopenable(
                "sealed by an earlier release, bound to its row but not to its claim: run "
                "`oncegate rekey` to re-seal it",
                name,
            )
        else:
            raise Unopenable(f"sealed under a binding this release does not know ({binding})", name)
        headers = _open(cipher, stored, stored.headers, bound(b"headers"))
        if stored.body is None:
            return header_pairs(headers), None
        return header_pairs(headers), _open(cipher, stored, stored.body, bound(b"body"))

    @property
    def request_sealed_with(self) -> str:
        """What new kept requests' `request_sealed_with` says: the newest key, and the binding."""
        return f"{self.current}:{REQUEST_BINDING}"

    def seal_request(
        self, scope: bytes, key: str, fingerprint: bytes, data: bytes
    ) -> SealedRequest:
        cipher = self._ciphers[self.current]
        bound = _request_bound(scope, key, fingerprint)
        return SealedRequest(self.request_sealed_with, _seal(cipher, data, bound))

    def open_request(
        self, scope: bytes, key: str, fingerprint: bytes, stored: SealedRequest
    ) -> bytes:
        if stored.key_name is None:
            return stored.data
        name, _, binding = stored.key_name.partition(":")
        cipher = self._ciphers.get(name)
        if cipher is None:
            raise Unopenable(
                f"sealed with key {name!r}, which ONCEGATE_ENCRYPTION_KEYS does not hold", name
            )
        if binding == REQUEST_BINDING:
            bound = _request_bound(scope, key, fingerprint)
        elif binding == "":
            # Sealed by a release before the fingerprint was bound: opened as it was sealed
            # (`oncegate rekey` re-seals it under the binding; a claim's kept request lives
            # only until its key settles).
            bound = _request_bound(scope, key)
        else:
            raise Unopenable(f"sealed under a binding this release does not know ({binding})", name)
        return _open_bytes(cipher, name, stored.data, bound)

    def reseal_request(
        self, scope: bytes, key: str, fingerprint: bytes, stored: SealedRequest
    ) -> SealedRequest:
        """A kept request sealed again under the newest key and binding (`oncegate rekey`)."""
        opened = self.open_request(scope, key, fingerprint, stored)
        return self.seal_request(scope, key, fingerprint, opened)

    def reseal(self, claim: Claimed, scope: bytes, stored: SealedAnswer) -> SealedAnswer:
        """A stored answer sealed again under the newest key and the claim binding (`oncegate
        rekey`): opened with the key that sealed it and the binding it was sealed under, or read
        as plaintext. Raises `Unopenable` when it cannot be opened, and then nothing is sealed:
        re-sealing must never lose an answer."""
        headers, body = self.open(claim, scope, stored, row_binding=True)
        return self.seal(claim, scope, headers, body)


class Sealer:
    """How answers are stored: sealed with a keyring, or in plaintext without one. Opens either
    kind (a plaintext row stays readable after a keyring is configured)."""

    def __init__(self, keyring: Keyring | None) -> None:
        self._keyring = keyring

    def seal(
        self, claim: Claimed, scope: bytes, headers: Sequence[tuple[str, str]], body: bytes | None
    ) -> SealedAnswer:
        if self._keyring is None:
            return plaintext(headers, body)
        return self._keyring.seal(claim, scope, headers, body)

    def open(
        self, claim: Claimed, scope: bytes, stored: SealedAnswer
    ) -> tuple[list[tuple[str, str]], bytes | None]:
        if self._keyring is None:
            return open_plain(stored)
        return self._keyring.open(claim, scope, stored)

    def seal_request(
        self, scope: bytes, key: str, fingerprint: bytes, data: bytes
    ) -> SealedRequest:
        if self._keyring is None:
            return SealedRequest(None, data)
        return self._keyring.seal_request(scope, key, fingerprint, data)

    def open_request(
        self, scope: bytes, key: str, fingerprint: bytes, stored: SealedRequest
    ) -> bytes:
        if self._keyring is not None:
            return self._keyring.open_request(scope, key, fingerprint, stored)
        if stored.key_name is not None:
            raise Unopenable(
                f"sealed with key {stored.key_name!r}, and ONCEGATE_ENCRYPTION_KEYS is not set",
                stored.key_name,
            )
        return stored.data


def plaintext(headers: Sequence[tuple[str, str]], body: bytes | None) -> SealedAnswer:
    """An answer stored as it is (no keyring)."""
    return SealedAnswer(key_name=None, headers=_headers_json(headers), body=body)


def open_plain(stored: SealedAnswer) -> tuple[list[tuple[str, str]], bytes | None]:
    """Open without a keyring: plaintext rows only."""
    if stored.key_name is not None:
        name = stored.key_name.partition(":")[0]
        raise Unopenable(f"sealed with key {name!r}, and ONCEGATE_ENCRYPTION_KEYS is not set", name)
    return header_pairs(stored.headers), stored.body


def _bound(claim: Claimed, scope: bytes, part: bytes) -> bytes:
    record_id, token = claim
    return b"oncegate:2:%d:%d:" % (record_id, token) + scope + b":" + part


def _row_bound(record_id: int, scope: bytes, part: bytes) -> bytes:
    """The associated data of earlier releases: the row, not the claim (`oncegate rekey` reads
    it to re-seal under `_bound`)."""
    return b"oncegate:1:" + str(record_id).encode() + b":" + scope + b":" + part


def _seal(cipher: AESGCM, data: bytes, associated: bytes) -> bytes:
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + cipher.encrypt(nonce, data, associated)


def _request_bound(scope: bytes, key: str, fingerprint: bytes | None = None) -> bytes:
    """A kept request's associated data: its scope and key, and its fingerprint (None: the
    binding of earlier releases)."""
    bound = b"oncegate:request:" + scope + b":" + key.encode()
    return bound if fingerprint is None else b"oncegate:request:f:" + fingerprint + b":" + bound


def _open(cipher: AESGCM, stored: SealedAnswer, data: bytes, associated: bytes) -> bytes:
    return _open_bytes(cipher, (stored.key_name or "").partition(":")[0], data, associated)


def _open_bytes(cipher: AESGCM, key_name: str, data: bytes, associated: bytes) -> bytes:
    if len(data) < _NONCE_BYTES + _TAG_BYTES:
        # AES-GCM refuses a short nonce with a ValueError, not InvalidTag: checked here.
        raise Unopenable(f"is cut short: {len(data)} bytes, less than a nonce and a tag", key_name)
    try:
        return cipher.decrypt(data[:_NONCE_BYTES], data[_NONCE_BYTES:], associated)
    except InvalidTag:
        raise Unopenable(
            "does not open: it was changed, moved from another row, or written back after its "
            "key was claimed again",
            key_name,
        ) from None


# `json.dumps` of the pairs, with the encoder made once (`model.jsontext`); read back as UTF-8
# (what the encoder writes is ASCII) by a decoder made once.
_write_json = jsontext.writer()
_DECODER = json.JSONDecoder()


def _headers_json(headers: Sequence[tuple[str, str]]) -> bytes:
    return _write_json(list(headers)).encode()


def header_pairs(data: bytes) -> list[tuple[str, str]]:
    """Header pairs from their stored JSON; `Unopenable` when it is not that (cut short or
    changed in the database: only a plaintext row can be, a sealed one does not open)."""
    try:
        text = data.decode("utf-8", "surrogatepass")  # what json.loads reads in bytes
        pairs = [(name, value) for name, value in _DECODER.decode(text)]
    except (ValueError, TypeError):
        raise Unopenable("its stored headers are not the JSON the gateway wrote", "") from None
    if not all(isinstance(name, str) and isinstance(value, str) for name, value in pairs):
        raise Unopenable("its stored headers are not the JSON the gateway wrote", "")
    return pairs
