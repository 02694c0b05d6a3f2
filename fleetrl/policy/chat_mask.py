"""A demonstration conversation as the policy's tokens, with the assistant's own tokens marked.

Design choice: the assistant spans are found by rendering prefixes of the conversation through the
model's chat template and taking differences, so any template that appends works (no `{% generation %}`
markers needed; SmolLM2's has none). For each assistant message i:

    before_i = template(messages[:i], add_generation_prompt=True)     ends with the assistant's header
    after_i  = template(messages[:i + 1])                              the reply and what closes it
    reply_i  = after_i[len(before_i):], cut after its last eos text (when it holds one)

Everything between one reply and the next header is context (mask 0): the template's closing text after
an eos, the user's and tools' messages, the next header. Each piece is tokenized on its own, which is the
token layout of an episode on the actors (`backends.conversation_tokens` for the first prompt, the
sampled reply ending in eos, `backends.observation_tokens` for what follows), so a model warm-started
here sees in RL the tokens it was trained on. Messages after the last assistant message train nothing
and are dropped. A template that renders an earlier turn differently once later turns follow (one that
drops earlier reasoning, or adds a default system prompt only when the first message is not the
assistant's) cannot be split this way: that conversation is refused, naming the message.

Contents are rendered as written (demonstrations are the tenant's own data, unlike an environment's
observations, which the actor escapes). No torch here: the gateway measures submitted conversations
with the same code the learner trains them with.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from fleetrl.errors import ConfigError, FieldViolation, FleetError
from fleetrl.spec.demonstrations import Demonstration
from fleetrl.spec.prompts import capped


class ConversationError(FleetError, ValueError):
    """A conversation the chat template cannot split into context and assistant tokens; `where` is the
    path within its line (`.messages[2]`)."""

    where: str

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where


NO_TEMPLATE = "the model's tokenizer has no chat template, which an sft job renders its conversations with"


@dataclass(frozen=True)
class MaskedTokens:
    """A conversation's token ids and, per token, whether it is the assistant's (trained)."""

    token_ids: list[int]
    mask: list[bool]

    @property
    def context_len(self) -> int:
        """Tokens before the first assistant token."""
        return self.mask.index(True)


def assistant_tokens(tokenizer: Any, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None = None) -> MaskedTokens:
    """The conversation up to its last assistant message through the chat template, the assistant's
    tokens marked (module docstring); ConversationError naming the message when it cannot be split."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConversationError("", NO_TEMPLATE)
    eos = tokenizer.eos_token or ""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for index in (i for i, message in enumerate(messages) if message["role"] == "assistant"):
        before = _render(tokenizer, messages[:index], tools, index, generation_prompt=True)
        after = _render(tokenizer, messages[: index + 1], tools, index, generation_prompt=False)
        if not before.startswith(done) or not after.startswith(before):
            raise ConversationError(f".messages[{index}]", "the chat template renders the turns before this "
                                    "assistant message differently once it follows, so its tokens cannot be "
                                    "told apart (an sft job needs a template that appends turns)")
        reply = after[len(before):]
        end = reply.rindex(eos) + len(eos) if eos and eos in reply else len(reply)
        pieces += [(before[len(done):], False), (reply[:end], True)]
        done = before + reply[:end]
    token_ids: list[int] = []
    mask: list[bool] = []
    for text, trained in pieces:
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []
        token_ids += ids
        mask += [trained] * len(ids)
    if True not in mask:
        raise ConversationError(".messages", "the assistant messages render to no tokens")
    if mask.index(True) == 0:
        raise ConversationError(".messages", "the conversation starts with an assistant token: there is no "
                                "context to predict it from")
    return MaskedTokens(token_ids, mask)


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, index: int,
            *, generation_prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                             tokenize=False)
    except (TemplateError, ValueError, TypeError, KeyError) as error:  # the template refused these messages
        raise ConversationError(f".messages[{index}]", f"the chat template cannot render the conversation up "
                                f"to here: {error}") from None
    return str(text)


def tokenize_demonstrations(tokenizer: Any, demonstrations: Iterable[Demonstration], max_seq_tokens: int,
                            field: str = "prompts") -> tuple[list[MaskedTokens], list[FieldViolation]]:
    """Every conversation's tokens, and a violation (`<field>[line N]...`) for each one that cannot be split or
    is longer than max_seq_tokens (`sft.max_seq_tokens`), at most MAX_REPORTED_LINES of them."""
    if not getattr(tokenizer, "chat_template", None):
        return [], [FieldViolation("model", NO_TEMPLATE)]
    out: list[MaskedTokens] = []
    bad: list[FieldViolation] = []
    for demonstration in demonstrations:
        where = f"{field}[line {demonstration.line}]"
        try:
            masked = assistant_tokens(tokenizer, demonstration.messages, demonstration.tools)
        except ConversationError as error:
            bad.append(FieldViolation(where + error.where, str(error)))
            continue
        if len(masked.token_ids) > max_seq_tokens:
            bad.append(FieldViolation(where, f"{len(masked.token_ids)} tokens through the chat template, more "
                                             f"than sft.max_seq_tokens ({max_seq_tokens})"))
            continue
        out.append(masked)
    return out, capped(bad, field)


def tokenized_or_raise(tokenizer: Any, demonstrations: Iterable[Demonstration], max_seq_tokens: int,
                       field: str = "prompts") -> list[MaskedTokens]:
    """`tokenize_demonstrations`, raising one ConfigError with its violations when there are any."""
    out, bad = tokenize_demonstrations(tokenizer, demonstrations, max_seq_tokens, field)
    if bad:
        raise ConfigError(f"bad {field} file", bad)
    return out
