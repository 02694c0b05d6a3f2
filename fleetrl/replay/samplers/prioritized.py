"""prioritized: off-policy. Groups drawn in proportion to their priority (set by the learner), each trained
up to max_reuse times; stale groups are skipped until evicted."""

from fleetrl.proto.fleetrl.v1 import replay_pb2
from fleetrl.replay.samplers.base import Sampler

PRIORITIZED = Sampler("prioritized", replay_pb2.SAMPLER_KIND_PRIORITIZED, "priority", drops_stale=False,
                      reuses=True)
