"""A token issuer for tests: real keys made here (RSA, P-256, an HMAC secret), a JWKS document
of their public halves written where a route reads it, and JWTs signed with them (PyJWT)."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

ISSUER = "https://issuer.test/"


class Issuer:
    def __init__(self, jwks_file: Path, issuer: str = ISSUER) -> None:
        self.jwks_file = jwks_file
        self.issuer = issuer
        self.keys: dict[str, tuple[str, Any]] = {}  # kid -> (algorithm, private key or secret)
        self.add("rsa-1", "RS256")
        self.add("ec-1", "ES256")
        self.add("hmac-1", "HS256")

    def add(self, kid: str, algorithm: str) -> None:
        """A new key in the set (the issuer rotating its keys), written to the file."""
        match algorithm:
            case "RS256":
                key: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            case "ES256":
                key = ec.generate_private_key(ec.SECP256R1())
            case _:
                key = secrets.token_bytes(32)
        self.keys[kid] = (algorithm, key)
        self.write()

    def drop(self, kid: str) -> None:
        del self.keys[kid]
        self.write()

    def write(self) -> None:
        documents = []
        for kid, (algorithm, key) in self.keys.items():
            match algorithm:
                case "RS256":
                    public = jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
                case "ES256":
                    public = jwt.algorithms.ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
                case _:
                    public = jwt.algorithms.HMACAlgorithm.to_jwk(key, as_dict=True)
            documents.append({**public, "kid": kid, "use": "sig"})
        self.jwks_file.write_text(json.dumps({"keys": documents}))

    def token(
        self,
        subject: str = "client-1",
        kid: str = "rsa-1",
        lifetime: float = 600,
        claims: dict[str, Any] | None = None,
        headers: dict[str, Any] | None = None,
    ) -> str:
        """A token of `subject`, signed with key `kid`; a new one on every call (its own iat
        and jti), as a refresh gives."""
        algorithm, key = self.keys[kid]
        now = int(time.time())
        payload = {"iss": self.issuer, "sub": subject, "iat": now, "exp": now + int(lifetime),
                   "jti": secrets.token_hex(8), **(claims or {})}  # fmt: skip
        return jwt.encode(
            payload, key, algorithm=algorithm, headers={"kid": kid, **(headers or {})}
        )

    def bearer(self, **options: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(**options)}"}
