"""The Tinker API: `fleetrl tinker`, an HTTP server the official `tinker` SDK talks to unchanged.

Components (`server.serve` wires them):
- `config`: TinkerSettings (environment prefix FLEETRL_TINKER_): listen address, tenant tokens
  (`fleetrl.runtime.tokens`, the gateway's), the model allow-list and the caps.
- `convert`: the SDK's JSON and protobuf bodies to `fleetrl.tinker.types` and results back.
- `client`: `TinkerClient`, the caller's live sessions (`GET /api/v1/sessions`) for `fleetrl top`.
- `metrics`: TenantGauges, the operator's per-tenant gauges (sessions, training runs, sampling sessions,
  requests queued and running, against the quotas) on the metrics port, read from the service at each scrape.
- `server`: the aiohttp routes, one error middleware mapping fleetrl errors to the HTTP statuses the
  SDK turns into its exception types, auth by `X-API-Key`, and the process lifecycle.

The domain (sessions, training runs, samplers, request ids) is `fleetrl.tinker.service.TinkerService`.
Endpoints, what is supported and what is not: docs/tinker.md.
"""
