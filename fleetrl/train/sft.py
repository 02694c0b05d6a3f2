"""An sft job: supervised fine-tuning on demonstration conversations, run by the learner like any job.

`SftRun` is a `JobRun` whose step data come from the job's demonstrations instead of replay (`next_data`): no
feeder, no actors, no reward, no leases. Everything else is JobRun's code: the step's stages (`run_step`), the
optimizer step (`optimizer_step`), the job lease and its fencing epoch, cancel and SIGTERM hand-back,
checkpoints (written, made complete and pruned alike), resume after a learner restart (`restore_latest`),
weight publication every `train.publish_interval` steps (so actors and evaluations can pull the result like
any job's), LoRA or full weights, data parallelism, the non-finite guard, metrics and the final export
(`jobs/<job>/model`, for LoRA also `jobs/<job>/adapter`). An RL job then starts from the
export with `model = "job:<this job's id>"` (the gateway resolves it for the same tenant only).

Steps: `setup` reads the demonstrations (`fleetrl.spec.demonstrations`) and tokenizes every conversation
once with the model's chat template, the assistant's tokens marked (`fleetrl.policy.chat_mask`). Step s
takes the `sft.conversations_per_step` conversations at positions (s - 1) * n .. s * n - 1 of an endless
stream that visits every conversation once per epoch, in `seeding.prompt_order(lines, seed, epoch)`,
so a step's batch is a function of its number alone and a resumed job needs nothing but the checkpoint's
step. Each conversation becomes a one-sample `Group` laid out as an episode is (context tokens, then the
rest with `loss_mask` 1 on the assistant's tokens), trained by `optim.train_step` under the `sft` preset
of `losses.PRESETS`: the `nll` surrogate, the mean negative log-likelihood of the step's assistant tokens.
"""

from __future__ import annotations

from fleetrl.policy.chat_mask import MaskedTokens, tokenized_or_raise
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.spec import seeding
from fleetrl.spec.demonstrations import read_demonstrations
from fleetrl.train.trainer import JobRun, StepData

SFT_METRICS = ("loss", "tokens", "sequences", "lr", "grad_norm", "nonfinite_steps", "entropy", "kl",
               "forward_backward_s", "optimizer_s")
"""The `train_step` metrics an sft step reports (the others measure rewards, ratios and clipping)."""


class SftRun(JobRun):
    """Trains one claimed sft job on its demonstrations (module docstring)."""

    conversations: list[MaskedTokens]
    """Every demonstration's tokens and assistant mask, in file order."""
    _order: tuple[int, list[int]] = (-1, [])

    async def setup(self) -> None:
        self.phase("starting")
        data, _ = await self.deps.jobs.files(self.job_id)
        demonstrations = read_demonstrations(data)
        await self.load_policy()
        self.conversations = await self.compute(tokenized_or_raise, self.policy.tokenizer, demonstrations,
                                                self.spec.sft.max_seq_tokens)
        await self.restore_latest()  # its step says where the conversations resume
        await self.start_publisher()

    async def next_data(self) -> StepData:
        """The step's conversations, at once (no replay to wait for)."""
        return self.step_data()

    def step_data(self) -> StepData:
        """The conversations of step `self.step + 1`, one group each."""
        per_step, lines = self.spec.sft.conversations_per_step, len(self.conversations)
        groups = []
        for position in range(self.step * per_step, (self.step + 1) * per_step):
            epoch, offset = divmod(position, lines)
            index = self.order(epoch)[offset]
            groups.append(self.group(seeding.task_id(epoch, index), self.conversations[index]))
        return StepData(groups=groups)

    def order(self, epoch: int) -> list[int]:
        """The conversations' order in `epoch` (the last one asked for is kept)."""
        if self._order[0] != epoch:
            self._order = (epoch, seeding.prompt_order(len(self.conversations), self.spec.seed, epoch))
        return self._order[1]

    def group(self, task_id: str, tokens: MaskedTokens) -> common_pb2.Group:
        """A conversation as a one-sample group: its context, then the rest with the assistant's tokens marked."""
        cut = tokens.context_len
        rest = tokens.token_ids[cut:]
        sample = common_pb2.Sample(prompt_token_ids=tokens.token_ids[:cut], completion_token_ids=rest,
                                   loss_mask=tokens.mask[cut:], behaviour_logprobs=[0.0] * len(rest),
                                   reward_status=common_pb2.REWARD_STATUS_OK)
        return common_pb2.Group(job_id=self.job_id, task_id=task_id, policy_version=self.step, samples=[sample])

    async def train(self, data: StepData) -> dict[str, float]:
        values = await self.optimizer_step(data.groups)
        out = {key: values[key] for key in (*SFT_METRICS, "nonfinite_steps_in_a_row") if key in values}
        out.update(epoch=self.step * self.spec.sft.conversations_per_step / len(self.conversations),
                   tokens_per_s=values["tokens_per_s"], step_time_s=values["step_time_s"])
        return out

    async def top_up(self) -> None:
        """An sft job publishes no tasks: nothing to top up."""

    def checkpoint_state(self) -> dict[str, object]:
        """An sft checkpoint needs no cursor and holds no leases: its step places the conversations."""
        return {"version": self.step, "lease_epoch": self.epoch}

    async def report_ledger(self) -> None:
        """An sft job publishes no tasks, so it has no ledger to account for."""
