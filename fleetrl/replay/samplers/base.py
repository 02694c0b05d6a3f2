"""What a replay sampler is: a name, its kind on the wire, and the properties the table's scripts read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleetrl.proto.fleetrl.v1 import replay_pb2
from fleetrl.spec.config import SamplerName

Selection = Literal["oldest", "uniform", "priority"]
"""Which groups a Sample picks: oldest first (insertion order), uniformly at random, or in proportion to
priority; the random ones draw without replacement from a per-call seed."""


@dataclass(frozen=True)
class Sampler:
    """A sampling strategy, Reverb-like: which groups a Sample picks (`selection`), what happens to
    groups too old to train on (`drops_stale`: removed and counted, else skipped until evicted), and
    whether a group returns after its commit (`reuses`, up to max_reuse). The scripts read these
    properties from the table's config hash, never the sampler's name."""

    name: SamplerName
    kind: replay_pb2.SamplerKind
    """Its `SamplerKind` on the wire."""
    selection: Selection
    drops_stale: bool
    reuses: bool

    def trainings_per_group(self, max_reuse: int) -> int:
        """How many times a group is trained on: once without reuse, else up to max_reuse."""
        return max(1, max_reuse) if self.reuses else 1
