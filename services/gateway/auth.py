"""Bearer-token authentication: the gRPC interceptor that checks the tenant tokens (`fleetrl.runtime.tokens`).

The interceptor wraps each JobService handler: a call without a valid
`authorization: Bearer <token>` is aborted with UNAUTHENTICATED before the servicer runs; a valid
one runs with the tenant in the `TENANT` context variable. Health and reflection are exempt, so
probes and `grpcurl list` work without a token. In open mode every caller is tenant `local`.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from fleetrl.errors import Unauthenticated
from fleetrl.runtime.tokens import OPEN_TENANT, TokenTable, hash_token

__all__ = ["OPEN_TENANT", "TENANT", "AuthInterceptor", "TokenTable", "current_tenant", "hash_token"]

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("fleetrl_tenant")


def current_tenant() -> str:
    """The tenant of the call being served (set by AuthInterceptor)."""
    return TENANT.get()


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
