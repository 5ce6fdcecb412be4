"""The bearer tokens file: one token per line, optionally followed by a principal.

::

    # comment lines and blank lines are ignored
    3b1f0c...            <- "TOKEN": may reach every pool (as before principals)
    9a7d2e... team-a     <- "TOKEN PRINCIPAL": is principal team-a

The file must not be accessible by others and must hold at least one token of
16 characters or more. A principal named on a line must be configured in
``[[security.principals]]``. Read when the daemon starts, and again on reload;
nothing here keeps a file open.

Tokens are kept as SHA-256 digests and looked up by digest: the comparison a
lookup does never involves the offered token's bytes, so its timing says
nothing about how much of a token was right.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvtierd.security.principals import UNRESTRICTED, Principal

MIN_TOKEN_CHARS = 16
MAX_TOKENS_FILE_BYTES = 1 << 20


class TokensFileError(ValueError):
    """The tokens file cannot be used; the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class TokenLine:
    token: str
    principal: str  # "" = every pool (a "TOKEN" line)
    line: int  # 1-based, for messages


def read_token_lines(path: str) -> tuple[TokenLine, ...]:
    """The token lines of ``path``; raises ``TokensFileError``."""
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            data = handle.read(MAX_TOKENS_FILE_BYTES + 1)
    except OSError as exc:
        raise TokensFileError(f"cannot read {path}: {exc.strerror}") from None
    if mode & 0o007:
        raise TokensFileError(f"{path} is accessible by others; chmod o-rwx")
    if len(data) > MAX_TOKENS_FILE_BYTES:
        raise TokensFileError(f"{path} is larger than {MAX_TOKENS_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokensFileError(f"{path} is not UTF-8 text") from None
    lines: list[TokenLine] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise TokensFileError(
                f"{path} line {number}: expected 'TOKEN' or 'TOKEN PRINCIPAL', got "
                f"{len(fields)} fields"
            )
        if len(fields[0]) < MIN_TOKEN_CHARS:
            raise TokensFileError(
                f"{path} line {number}: tokens must be at least {MIN_TOKEN_CHARS} characters"
            )
        lines.append(TokenLine(fields[0], fields[1] if len(fields) == 2 else "", number))
    if not lines:
        raise TokensFileError(f"{path} must hold tokens of at least {MIN_TOKEN_CHARS} characters")
    return tuple(lines)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def token_table(
    path: str, lines: tuple[TokenLine, ...], principals: Mapping[str, Principal]
) -> Mapping[bytes, Principal]:
    """Token digest -> principal. A bare token is ``UNRESTRICTED``; a line naming
    a principal that is not configured is refused (``TokensFileError``), as is
    one token listed twice."""
    table: dict[bytes, Principal] = {}
    for line in lines:
        if not line.principal:
            principal = UNRESTRICTED
        elif line.principal in principals:
            principal = principals[line.principal]
        else:
            known = ", ".join(sorted(principals)) or "none configured"
            raise TokensFileError(
                f"{path} line {line.line}: principal {line.principal!r} is not in "
                f"[[security.principals]] (known: {known})"
            )
        digest = token_digest(line.token)
        if digest in table:
            raise TokensFileError(f"{path} line {line.line}: this token is listed twice")
        table[digest] = principal
    return table
