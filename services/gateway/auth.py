"""Bearer-token authentication: a table of hashed tokens and the gRPC interceptor that checks them.

Tokens are compared as sha256 digests with `hmac.compare_digest`, so the table holds no secret and
a comparison leaks no timing. The interceptor wraps each JobService handler: a call without a valid
`authorization: Bearer <token>` is aborted with UNAUTHENTICATED before the servicer runs; a valid
one runs with the tenant in the `TENANT` context variable. Health and reflection are exempt, so
probes and `grpcurl list` work without a token. In open mode every caller is tenant `local`.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from fleetrl.errors import Unauthenticated

OPEN_TENANT = "local"
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("fleetrl_tenant")


def hash_token(token: str) -> str:
    """The sha256 hex digest stored for a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def current_tenant() -> str:
    """The tenant of the call being served (set by AuthInterceptor)."""
    return TENANT.get()


class TokenTable:
    """Tenant lookup by token; open mode maps everyone to `local`."""

    digests: dict[str, str]
    open_mode: bool

    def __init__(self, digests: dict[str, str], open_mode: bool = False) -> None:
        self.digests = dict(digests)
        self.open_mode = open_mode

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant an `authorization` header value belongs to; Unauthenticated if none."""
        if self.open_mode:
            return OPEN_TENANT
        if not authorization:
            raise Unauthenticated("missing authorization metadata: send 'authorization: Bearer <token>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
        digest = hash_token(token.strip())
        found = None
        for tenant, known in self.digests.items():  # no early exit: time does not depend on the match
            if hmac.compare_digest(digest, known):
                found = tenant
        if found is None:
            raise Unauthenticated("invalid token")
        return found


def _authorization(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return value if isinstance(value, str) else value.decode()
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token of every non-exempt call and runs the handler as its tenant."""

    table: TokenTable

    def __init__(self, table: TokenTable) -> None:
        self.table = table

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        try:
            tenant: str | None = self.table.tenant_for(
                _authorization(handler_call_details.invocation_metadata))  # type: ignore[attr-defined]
            reason = ""
        except Unauthenticated as error:
            tenant, reason = None, str(error)
        return _wrap(handler, tenant, reason)


def _wrap(handler: Any, tenant: str | None, reason: str) -> Any:
    """The same handler, run as tenant, or aborting UNAUTHENTICATED when tenant is None."""
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if tenant is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
            TENANT.set(tenant)  # type: ignore[arg-type]
            return await inner(request, context)

        return handler._replace(unary_unary=unary)
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if tenant is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
            TENANT.set(tenant)  # type: ignore[arg-type]
            async for item in inner_stream(request, context):
                yield item

        return handler._replace(unary_stream=stream)
    raise TypeError(f"JobService has no client-streaming RPCs; cannot guard {handler}")
