"""uniform: off-policy. Groups drawn uniformly at random, each trained up to max_reuse times; stale groups
are skipped until evicted."""

from fleetrl.proto.fleetrl.v1 import replay_pb2
from fleetrl.replay.samplers.base import Sampler

UNIFORM = Sampler("uniform", replay_pb2.SAMPLER_KIND_UNIFORM, "uniform", drops_stale=False, reuses=True)
