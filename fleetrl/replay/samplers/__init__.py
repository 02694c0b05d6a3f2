"""Replay samplers as objects, one file each (the way of Reverb's selectors): what a Sample picks, what
becomes of stale groups, and whether a group is trained on more than once.

`SAMPLERS` maps the names a job spec uses (`replay.sampler`, `fleetrl.spec.config.SamplerName`) to the
samplers, and `SAMPLERS_BY_KIND` the wire's `SamplerKind`s: the one vocabulary the spec, the learner,
the replay client, the table and its scripts share. Adding a sampler is one file here, its name in
`SamplerName` and a selection the scripts know.
"""

from __future__ import annotations

from fleetrl.proto.fleetrl.v1 import replay_pb2
from fleetrl.replay.samplers.base import Sampler, Selection
from fleetrl.replay.samplers.fifo import FIFO
from fleetrl.replay.samplers.prioritized import PRIORITIZED
from fleetrl.replay.samplers.uniform import UNIFORM

SAMPLERS: dict[str, Sampler] = {s.name: s for s in (FIFO, UNIFORM, PRIORITIZED)}
"""The samplers by name."""
SAMPLERS_BY_KIND: dict[int, Sampler] = {replay_pb2.SAMPLER_KIND_UNSPECIFIED: FIFO,
                                        **{s.kind: s for s in SAMPLERS.values()}}
"""The samplers by their `SamplerKind` on the wire (UNSPECIFIED means fifo)."""

__all__ = ["FIFO", "PRIORITIZED", "SAMPLERS", "SAMPLERS_BY_KIND", "UNIFORM", "Sampler", "Selection"]
