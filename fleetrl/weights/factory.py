"""The transport a service's settings choose: NATS JetStream (`jetstream.NatsTransport`) unless `weights_dir`
names a directory, then the file system there (`filesystem.FilesystemTransport`).

Every learner, actor and gateway of a fleet must choose the same: the learner publishes where the actors pull
(each through a `WeightChannel` over this transport), and the gateway deletes a job's weights where they are
(`fleetrl.jobs.retention`). Imports no torch, as the gateway does not.
"""

from __future__ import annotations

from pathlib import Path

import nats.aio.client
from nats.js import JetStreamContext

from fleetrl.weights.filesystem import FilesystemTransport
from fleetrl.weights.jetstream import NatsTransport
from fleetrl.weights.transport import Transport


def transport(weights_dir: Path | None, nc: nats.aio.client.Client, js: JetStreamContext) -> Transport:
    """Files under `weights_dir`, or NATS over this connection when it is None."""
    return NatsTransport(nc, js) if weights_dir is None else FilesystemTransport(weights_dir)
