"""The operator's view of every tenant on the Tinker service: per-tenant gauges on its /metrics.

`TenantGauges` is a Prometheus collector read at scrape time from `TinkerService.tenants()`, so a
figure is the service's own records at that moment (no update loop, no series left behind by a
finished session). The `tenant` label takes the names of the operator's token table (and `local` in
open mode), every one of them listed even when it holds nothing; its cardinality is that table's size.
The quotas are label-free gauges beside them (`fleetrl_tinker_sessions / on() group_left
fleetrl_tinker_max_sessions_per_tenant` is each tenant's use of its quota).

/metrics is the operator's port (`metrics_port`), not the Tinker API's: no tenant-facing call returns
another tenant's figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from fleetrl.tinker.service import Limits, TinkerService
from fleetrl.tinker.types import TenantLoad

PER_TENANT: tuple[tuple[str, str, Callable[[TenantLoad], float]], ...] = (
    ("fleetrl_tinker_sessions", "Live sessions each tenant holds (its max_sessions_per_tenant counts these)",
     lambda t: t.sessions),
    ("fleetrl_tinker_training_runs", "Training runs each tenant holds, created or queued for creation (its "
     "max_training_runs_per_tenant counts these)", lambda t: t.training_runs),
    ("fleetrl_tinker_sampling_sessions", "Sampling sessions each tenant holds", lambda t: t.sampling_sessions),
    ("fleetrl_tinker_requests_queued", "Each tenant's requests queued for the work thread",
     lambda t: t.requests_queued),
    ("fleetrl_tinker_requests_running", "Each tenant's requests running now", lambda t: t.requests_running),
    ("fleetrl_tinker_optim_steps", "optim_steps applied, summed over each tenant's live training runs",
     lambda t: t.optim_steps),
    ("fleetrl_tinker_adapter_bytes", "Bytes of each tenant's own tensors: adapters, gradients and optimizer "
     "moments of its runs, saved adapters of its sampling sessions (shared base models not counted)",
     lambda t: t.adapter_bytes),
)
QUOTAS = (
    ("fleetrl_tinker_max_sessions_per_tenant", "The live sessions one tenant may hold (the setting)",
     "max_sessions_per_tenant"),
    ("fleetrl_tinker_max_training_runs_per_tenant", "The training runs one tenant may hold (the setting)",
     "max_training_runs_per_tenant"),
)
LAST_REQUEST = ("fleetrl_tinker_last_request_age_seconds",
                "Seconds since the last request of any of each tenant's live sessions (absent: no session)")


class TenantGauges:
    """The per-tenant gauges and the quotas, read from the service at each scrape."""

    service: TinkerService
    tenants: tuple[str, ...]
    """The token table's tenants, listed even when they hold nothing."""

    def __init__(self, service: TinkerService, tenants: Iterable[str]) -> None:
        self.service, self.tenants = service, tuple(tenants)

    def describe(self) -> Iterator[Metric]:
        return families([], None)

    def collect(self) -> Iterator[Metric]:
        return families(self.service.tenants(self.tenants), self.service.limits)


def families(loads: list[TenantLoad], limits: Limits | None) -> Iterator[Metric]:
    """The gauges of `loads` and of the quotas in `limits` (None: the families without samples)."""
    for name, doc, value in PER_TENANT:
        family = GaugeMetricFamily(name, doc, labels=["tenant"])
        for load in loads:
            family.add_metric([load.tenant], value(load))
        yield family
    ages = GaugeMetricFamily(*LAST_REQUEST, labels=["tenant"])
    for load in loads:
        if load.last_request_age_s is not None:
            ages.add_metric([load.tenant], load.last_request_age_s)
    yield ages
    for name, doc, setting in QUOTAS:
        quota = GaugeMetricFamily(name, doc, labels=[])
        if limits is not None:
            quota.add_metric([], getattr(limits, setting))
        yield quota


def registry(gauges: TenantGauges) -> CollectorRegistry:
    """What the service's metrics port serves: the process's families (HTTP and work histograms) and its
    tenants' gauges. A registry of its own, so two services in one process (tests) do not clash."""
    served = CollectorRegistry()
    served.register(REGISTRY)
    served.register(gauges)
    return served
