"""fifo: on-policy. Oldest group first, each trained once, a group too stale to train on is dropped and
counted."""

from fleetrl.proto.fleetrl.v1 import replay_pb2
from fleetrl.replay.samplers.base import Sampler

FIFO = Sampler("fifo", replay_pb2.SAMPLER_KIND_FIFO, "oldest", drops_stale=True, reuses=False)
