"""A stored answer and a kept request, as the key table holds them: one value each from the
upstream's answer (or the client's request) down to the columns and back. Sealed under a named
key or in plaintext; `kernel.sealing` seals and opens them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SealedAnswer:
    """An answer's headers and body as they are stored: sealed under `key_name`, or in plaintext
    when `key_name` is None."""

    key_name: str | None
    headers: bytes  # JSON of the header pairs, sealed or not
    # None when the answer was larger than the route's `max_stored_response`: its headers were
    # stored, not its body. `store: status_only` stores an empty one (a constraint of the key
    # table says an answer stored whole has a body).
    body: bytes | None


@dataclass(frozen=True, slots=True)
class StoredAnswer:
    """What a completed key answers with, as the store holds it: one value from the upstream's
    answer (or an operator's resolution) down to the key table's columns and back
    (`store.postgres.rows` maps it to and from them; `Sealer.open` opens it).

    `content` is the headers and body, sealed or in plaintext. An answer larger than the route's
    `max_stored_response` has its headers and no body (`content.body` None): it is not `stored`
    whole, and a retry gets 409 `response-not-stored`. `content` is None only for such an answer
    completed by an earlier release, which kept its status alone."""

    status: int
    content: SealedAnswer | None

    @property
    def stored(self) -> bool:
        """Stored whole, so it can be replayed."""
        return self.content is not None and self.content.body is not None


@dataclass(frozen=True, slots=True)
class SealedRequest:
    """A kept request (the request behind a key, `service.evidence` encodes it) as stored:
    sealed under `key_name`, or in plaintext when `key_name` is None. It is bound to its key
    (scope and key) and its request's fingerprint rather than to a claim: the claim's insert
    writes it before the row has an id. Copied into another key's row, or written back into its
    own after a claim of another request, it does not open."""

    key_name: str | None
    data: bytes
