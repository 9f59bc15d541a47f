"""Bearer tokens with ``read`` and ``admin`` scopes.

The token file (``--auth-tokens FILE``) holds one token per line::

    # scope  token                              name (optional, shown in logs)
    admin    3f9c0d6e1b2a4c8d9e7f6a5b4c3d2e1f   ops
    read     8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d   dashboard

Blank lines and lines starting with ``#`` are ignored. A token is at least 16
characters with no spaces (``python -c "import secrets; print(secrets.token_hex(16))"``
makes one). ``read`` allows every query and description; ``admin`` also allows the calls
that change data (Upload, DeleteRows, DropDataset).

Clients send ``authorization: Bearer <token>`` metadata. A missing or unknown token is
UNAUTHENTICATED; a read token on a changing call is PERMISSION_DENIED. Tokens are kept
only as SHA-256 digests and compared with ``hmac.compare_digest`` against every known
digest, so the time taken does not depend on how much of a guess was right nor on which
token matched. Health checks and reflection stay open.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SCOPES = ("read", "admin")
#: RPCs of the GeoNear service that change data: admin scope only.
ADMIN_METHODS = frozenset(
    f"/geonear.v1.GeoNear/{name}" for name in ("Upload", "DeleteRows", "DropDataset")
)
MIN_TOKEN_CHARS = 16


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the line."""


@dataclass(frozen=True)
class Denial:
    """Why a call was refused: a status code name and the message for the caller."""

    status: str
    message: str


_MISSING = Denial(
    "UNAUTHENTICATED",
    "this server needs a bearer token: send metadata 'authorization: Bearer <token>' "
    "(geonear --token, geonear.connect(token=...))",
)
_UNKNOWN = Denial("UNAUTHENTICATED", "the bearer token is not one this server knows")
_READ_ONLY = Denial(
    "PERMISSION_DENIED",
    "this token has the read scope; uploads, deletes and drops need an admin token",
)


@dataclass(frozen=True)
class Token:
    scope: str
    digest: bytes
    name: str


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def parse_tokens(text: str, source: str = "token file") -> list[Token]:
    """Tokens of a token file's text; raises TokenFileError naming a bad line."""
    tokens: list[Token] = []
    seen: set[bytes] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{source}, line {number}"
        if len(fields) not in (2, 3):
            raise TokenFileError(f"{where}: expected 'scope token [name]'")
        scope, token = fields[0], fields[1]
        if scope not in SCOPES:
            raise TokenFileError(
                f"{where}: scope must be one of {', '.join(SCOPES)}, got {scope!r}"
            )
        if len(token) < MIN_TOKEN_CHARS:
            raise TokenFileError(f"{where}: tokens need at least {MIN_TOKEN_CHARS} characters")
        digest = _digest(token)
        if digest in seen:
            raise TokenFileError(f"{where}: this token appears twice")
        seen.add(digest)
        tokens.append(Token(scope, digest, fields[2] if len(fields) == 3 else f"line{number}"))
    if not tokens:
        raise TokenFileError(f"{source}: no tokens; a server with --auth-tokens needs one")
    return tokens


def load_tokens(path: Path) -> list[Token]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TokenFileError(f"cannot read token file {path}: {exc.strerror}") from exc
    return parse_tokens(text, str(path))


class TokenCheck:
    """Decides, per call, whether its bearer token allows the method."""

    def __init__(self, tokens: Sequence[Token]) -> None:
        self._tokens = tuple(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def scope_of(self, token: str) -> str | None:
        """The scope of ``token``, or None; constant time in the token's content."""
        digest = _digest(token)
        scope = None
        for known in self._tokens:
            # No early exit: every digest is compared whichever one matches.
            if hmac.compare_digest(digest, known.digest):
                scope = known.scope
        return scope

    def check(
        self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None
    ) -> Denial | None:
        """None when the call may proceed, else why not."""
        token = bearer_token(metadata)
        if token is None:
            return _MISSING
        scope = self.scope_of(token)
        if scope is None:
            return _UNKNOWN
        if scope != "admin" and method in ADMIN_METHODS:
            return _READ_ONLY
        return None


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry, if there is one."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None
