"""An actor's Tinker samplers count in its memory budget: their adapters' bytes are told to the budget after
every change, and past it the least recently used are dropped, never the one a sample is using."""

from __future__ import annotations

import asyncio
import json

from fleetrl.spec.config import LoraSpec
from fleetrl.tinker.fleet import ActorSampling, encode_request
from fleetrl.tinker.sampling import SamplerWeights
from fleetrl.tinker.types import SampleParams
from tests.tinker.conftest import MODEL

PARAMS = SampleParams(prompt=[1000, 1001, 1002], num_samples=1, max_tokens=2, temperature=1.0, top_p=1.0, seed=1,
                      stop_tokens=frozenset(), prompt_logprobs=False)


def request(namespace: str, rank: int) -> bytes:
    """A sample from a fresh adapter of `namespace` (no version pulled: B = 0), as a training run's first."""
    return encode_request(SamplerWeights(namespace, MODEL, LoraSpec(rank=rank), job_id=namespace), PARAMS)


def test_samplers_tell_the_budget_what_they_hold_and_drop_the_least_recently_used_past_it() -> None:
    told: list[int] = []
    limit = [1 << 40]

    def account(held: int) -> bool:
        told.append(held)
        return held <= limit[0]

    async def main() -> None:
        sampling = ActorSampling(None, 16, dtype="float32", device="cpu", account=account)  # type: ignore[arg-type]
        try:
            for namespace, rank in (("tk-a-0", 4), ("tk-b-0", 8), ("tk-c-0", 4)):
                answer = json.loads(await sampling.serve(request(namespace, rank)))
                assert "error" not in answer and len(answer["sequences"]) == 1, answer
            sizes = {key: adapter.bytes for key, adapter in sampling._adapters.items()}
            assert sizes["tk-b-0"] == 2 * sizes["tk-a-0"] == 2 * sizes["tk-c-0"] > 0  # rank 8 against rank 4
            assert told[-1] == sum(sizes.values()) == sampling.held_bytes()

            limit[0] = sizes["tk-a-0"] + sizes["tk-b-0"]  # room for two of them
            assert "error" not in json.loads(await sampling.serve(request("tk-b-0", 8)))  # b used again: a is oldest
            assert list(sampling._adapters) == ["tk-c-0", "tk-b-0"] and told[-1] <= limit[0]
            limit[0] = 1  # not even the one in use: it is kept for its sample, the rest dropped
            assert "error" not in json.loads(await sampling.serve(request("tk-d-0", 4)))
            assert list(sampling._adapters) == ["tk-d-0"] and told[-1] == sizes["tk-a-0"]
        finally:
            await sampling.close()
        assert told[-1] == 0

    asyncio.run(main())
