"""`WeightStore`, the weight channel (`fleetrl.weights.channel`) over NATS JetStream
(`fleetrl.weights.jetstream.NatsTransport`) built from a connection, with the names its callers import with it."""

from __future__ import annotations

import nats.aio.client
from nats.js import JetStreamContext

from fleetrl.weights.channel import HeldWeights, WeightChannel, WeightPointer, decode_safetensors, encode_safetensors
from fleetrl.weights.jetstream import CHUNK_BYTES, NatsTransport

__all__ = ["CHUNK_BYTES", "HeldWeights", "NatsTransport", "WeightPointer", "WeightStore", "decode_safetensors",
           "encode_safetensors"]
"""With the channel's and the transport's names that callers of the NATS store import from here."""


class WeightStore(WeightChannel):
    """The weight channel over NATS (`NatsTransport`), as tests and benches build it (the services choose their
    transport through `fleetrl.weights.factory`). One instance per NATS connection."""

    transport: NatsTransport

    def __init__(self, nc: nats.aio.client.Client, js: JetStreamContext, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        """`chunk_bytes` is capped below the server's max_payload at publish time."""
        super().__init__(NatsTransport(nc, js, chunk_bytes=chunk_bytes))

    async def sweep_stray_chunks(self, job_id: str) -> int:
        """`NatsTransport.sweep_stray_chunks`, which every write runs first."""
        return await self.transport.sweep_stray_chunks(job_id)
