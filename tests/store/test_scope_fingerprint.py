"""Admin records of one key used by two credentials can be told apart."""

from __future__ import annotations

import uuid

from oncegate.kernel import keys
from oncegate.model.records import Claim
from oncegate.store.postgres import PostgresStore


async def test_two_scopes_of_one_key_have_two_short_fingerprints(store: PostgresStore) -> None:
    key = str(uuid.uuid4())
    credentials = ["Bearer ana-secret-token", "Bearer bob-secret-token"]
    scopes = [keys.scope("mail", [[credential]]) for credential in credentials]
    for scope in scopes:
        claim = await store.requests.claim("mail", scope, key, b"\x00" * 32, 60, 3600)
        assert isinstance(claim, Claim)
    records = await store.operator.find(key, None)
    fingerprints = [record.scope_fingerprint for record in records]
    assert sorted(fingerprints) == sorted(scope[:6].hex() for scope in scopes)
    assert len(set(fingerprints)) == 2 and all(len(value) == 12 for value in fingerprints)
    for credential in credentials:
        assert all(credential.split()[1] not in value for value in fingerprints)
