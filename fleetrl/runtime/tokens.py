"""Tenant tokens: the hashed token table every authenticating service checks, and its settings.

The gateway (gRPC `authorization: Bearer <token>`) and the Tinker API (HTTP `X-API-Key: <token>`)
both map a caller's token to its tenant with one `TokenTable`, built from the same settings fields
(`TokenSettings`: `tokens`, `tokens_file`, `open_mode`), so one tenant token works on both.

Tokens are compared as sha256 digests with `hmac.compare_digest`, so the table holds no secret and
a comparison leaks no timing. Auth is closed by default: a service with no tokens and `open_mode =
false` refuses to start (`auth_table`), so forgetting to configure tokens never exposes anything. In
open mode every caller is tenant `local`.

`operators` names the tenants whose callers may also read every tenant's rows of the fleet's listings
(`fleetrl top --all-tenants`: the gateway's GetFleet and ListJobs, the Tinker API's sessions), asked for
explicitly each time (`TokenTable.viewer`). Reading only: every other call still acts as the caller's own
tenant, so an operator cannot fetch, cancel, delete, account or download another tenant's job.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Iterable
from pathlib import Path

from pydantic import Field, field_validator

from fleetrl.errors import ConfigError, FieldViolation, PermissionDenied, Unauthenticated
from fleetrl.spec.config import Strict, read_toml

OPEN_TENANT = "local"
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def hash_token(token: str) -> str:
    """The sha256 hex digest stored for a token."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenTable:
    """Tenant lookup by token; open mode maps everyone to `local`."""

    digests: dict[str, str]
    open_mode: bool
    operators: frozenset[str]

    def __init__(self, digests: dict[str, str], open_mode: bool = False, operators: Iterable[str] = ()) -> None:
        self.digests = dict(digests)
        self.open_mode = open_mode
        self.operators = frozenset(operators)

    def viewer(self, tenant: str, all_tenants: bool) -> str | None:
        """Whose rows a listing shows the caller: its tenant's, or with `all_tenants` every tenant's (None), which
        only an operator may ask for (PermissionDenied). In open mode the one tenant is the operator."""
        if not all_tenants:
            return tenant
        if not (self.open_mode or tenant in self.operators):
            raise PermissionDenied(f"tenant {tenant!r} is not an operator: only the tenants in the service's "
                                   "`operators` setting may list every tenant's rows")
        return None

    def tenants(self) -> tuple[str, ...]:
        """Every tenant a caller can be: the table's, or `local` in open mode."""
        return (OPEN_TENANT,) if self.open_mode else tuple(sorted(self.digests))

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant an `authorization` header value (`Bearer <token>`) belongs to; Unauthenticated if none."""
        if self.open_mode:
            return OPEN_TENANT
        if not authorization:
            raise Unauthenticated("missing authorization metadata: send 'authorization: Bearer <token>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
        return self.tenant_for_token(token.strip())

    def tenant_for_token(self, token: str | None) -> str:
        """The tenant a bare token belongs to; Unauthenticated if none."""
        if self.open_mode:
            return OPEN_TENANT
        if not token:
            raise Unauthenticated("missing token")
        digest = hash_token(token)
        found = None
        for tenant, known in self.digests.items():  # no early exit: time does not depend on the match
            if hmac.compare_digest(digest, known):
                found = tenant
        if found is None:
            raise Unauthenticated("invalid token")
        return found


class TokenSettings(Strict):
    """The settings of a service that authenticates tenants by token."""

    tokens: dict[str, str] = Field(default_factory=dict)
    """Tenant -> sha256 hex digest of its bearer token."""
    tokens_file: Path | None = None
    """TOML file of `tenant = "sha256 hex"` lines, merged into `tokens`."""
    open_mode: bool = False
    """No authentication: every caller is tenant `local`. For a single-user machine only."""
    operators: list[str] = Field(default_factory=list, max_length=64)
    """Tenants (of `tokens`) whose callers may also list every tenant's jobs, fleet rows and Tinker sessions
    (`fleetrl top --all-tenants`); reading only: they act on their own tenant's jobs alone."""

    @field_validator("tokens")
    @classmethod
    def _hashes(cls, tokens: dict[str, str]) -> dict[str, str]:
        bad = [tenant for tenant, digest in tokens.items() if not _SHA256_HEX.match(digest)]
        if bad:
            raise ValueError(f"tokens of {', '.join(bad)} are not sha256 hex digests (use hash-token)")
        return tokens

    def token_table(self) -> dict[str, str]:
        """tokens merged with tokens_file; ConfigError if a digest is malformed."""
        table = dict(self.tokens)
        if self.tokens_file is not None:
            data = read_toml(self.tokens_file, "tokens_file")
            tokens = data.get("tokens", data)
            if not isinstance(tokens, dict):
                raise ConfigError("invalid tokens", [FieldViolation("tokens_file", f"{self.tokens_file}: "
                                                                   "[tokens] must be a table")])
            table.update(tokens)
        bad = [FieldViolation(f"tokens.{t}", "not a sha256 hex digest") for t, d in table.items()
               if not isinstance(d, str) or not _SHA256_HEX.match(d)]
        if not self.open_mode:
            bad += [FieldViolation(f"operators[{i}]", f"{tenant!r} is not a tenant of tokens or tokens_file")
                    for i, tenant in enumerate(self.operators) if tenant not in table]
        if bad:
            raise ConfigError("invalid tokens", bad)
        return table


def auth_table(settings: TokenSettings, service: str, log: logging.Logger) -> TokenTable:
    """The auth table; refuses a closed service without tokens, shouts about open mode."""
    digests = settings.token_table()
    if settings.open_mode:
        log.warning("!!! OPEN MODE: no authentication, every caller is tenant 'local'. "
                    "Use only on a single-user machine; configure tokens for anything else. !!!")
        if digests:
            log.warning("open mode ignores the %d configured tokens", len(digests))
    elif not digests:
        raise ConfigError(f"{service} settings", [FieldViolation(
            "tokens", "no tokens configured: set tokens or tokens_file, or open_mode = true for local use")])
    if settings.operators and not settings.open_mode:
        log.info("operators (may list every tenant's rows): %s", ", ".join(sorted(settings.operators)))
    return TokenTable(digests, settings.open_mode, settings.operators)
