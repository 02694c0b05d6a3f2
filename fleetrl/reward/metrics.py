"""Prometheus metrics of one reward service instance, in a private registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RewardMetrics:
    """Items scored per job and status (errors by kind), latency, worker replacements, pools."""

    registry: CollectorRegistry
    items: Counter
    latency: Histogram
    worker_restarts: Counter
    pools: Gauge
    sandbox_layer: Gauge
    episodes: Counter
    open_episodes: Gauge
    env_latency: Histogram

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.items = Counter("fleetrl_reward_items_total", "Items scored, by job and status",
                             ["job", "status"], registry=self.registry)
        self.latency = Histogram("fleetrl_reward_latency_seconds", "Wall-clock seconds per item on a worker",
                                 ["status"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.worker_restarts = Counter(
            "fleetrl_reward_worker_restarts_total",
            "Workers killed and replaced, by reason (timeout, crash, cancelled, recycled, dirty: user code outlived "
            "its call)",
            ["reason"], registry=self.registry)
        self.pools = Gauge("fleetrl_reward_pools", "Live worker pools (one per job and spec)", registry=self.registry)
        self.sandbox_layer = Gauge("fleetrl_reward_sandbox_layer",
                                   "1 when a sandbox layer held at start-up (bwrap, mountns, pidns, netns, seccomp)",
                                   ["layer"], registry=self.registry)

        self.episodes = Counter("fleetrl_reward_episodes_total",
                                "Episodes ended, by job and status (done, error, timeout, killed, closed, abandoned)",
                                ["job", "status"], registry=self.registry)
        self.open_episodes = Gauge("fleetrl_reward_open_episodes", "Episodes open (each holds a worker)",
                                   registry=self.registry)
        self.env_latency = Histogram("fleetrl_reward_env_seconds", "Wall-clock seconds per environment reset or step",
                                     ["op"], buckets=LATENCY_BUCKETS_S, registry=self.registry)

    def observe(self, job_id: str, status: str, latency_s: float) -> None:
        self.items.labels(job=job_id, status=status).inc()
        self.latency.labels(status=status).observe(latency_s)

    def worker_replaced(self, reason: str) -> None:
        self.worker_restarts.labels(reason=reason).inc()

    def sandbox_layers(self, layers: dict[str, bool]) -> None:
        for layer, held in layers.items():
            self.sandbox_layer.labels(layer=layer).set(1.0 if held else 0.0)
