"""The assistant-only mask of an sft conversation, on the SmolLM2 chat template (the tiny models' tokenizer):
exact on a multi-turn conversation with a tool message, equal to what transformers' own assistant mask gives
for the same template with `{% generation %}` markers, and refused where a template cannot be split."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetrl.policy import models
from fleetrl.policy.chat_mask import ConversationError, assistant_tokens, tokenize_demonstrations
from fleetrl.spec.demonstrations import read_demonstrations

CONVERSATION = [
    {"role": "system", "content": "Use <tool_call>calc(expression)</tool_call> for arithmetic."},
    {"role": "user", "content": "What is 17 * 23?"},
    {"role": "assistant", "content": "<tool_call>calc(17 * 23)</tool_call>"},
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "17 * 23 = 391"},
    {"role": "user", "content": "Thanks!"},  # after the last assistant message: trains nothing, dropped
]
MARKED = (  # SmolLM2's template with the assistant's reply and its <|im_end|> inside {% generation %}
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def loaded(tiny_model_cache: Path) -> Any:
    return models.smollm2_tokenizer(tiny_model_cache)


@pytest.fixture
def tokenizer(loaded: Any) -> Iterator[Any]:
    """The SmolLM2 tokenizer, its chat template restored after the test."""
    template = loaded.chat_template
    yield loaded
    loaded.chat_template = template


def spans(tokenizer: Any, token_ids: list[int], mask: list[bool]) -> list[tuple[bool, str]]:
    """The decoded runs of equal mask values, in order."""
    out: list[tuple[bool, list[int]]] = []
    for token, trained in zip(token_ids, mask, strict=True):
        if out and out[-1][0] == trained:
            out[-1][1].append(token)
        else:
            out.append((trained, [token]))
    return [(trained, tokenizer.decode(ids)) for trained, ids in out]


def test_the_mask_is_exactly_the_assistant_replies_and_their_end_tokens(tokenizer: Any) -> None:
    masked = assistant_tokens(tokenizer, CONVERSATION)
    assert spans(tokenizer, masked.token_ids, masked.mask) == [
        (False, "<|im_start|>system\nUse <tool_call>calc(expression)</tool_call> for arithmetic.<|im_end|>\n"
                "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n"),
        (True, "<tool_call>calc(17 * 23)</tool_call><|im_end|>"),
        (False, "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"),
        (True, "17 * 23 = 391<|im_end|>"),
    ]
    # the tokens are the template's rendering tokenized whole, up to the last reply's end token
    whole = tokenizer(tokenizer.apply_chat_template(CONVERSATION[:5], tokenize=False),
                      add_special_tokens=False)["input_ids"]
    assert masked.token_ids == whole[: len(masked.token_ids)] and len(whole) == len(masked.token_ids) + 1
    assert masked.context_len == masked.mask.index(True) > 0


def test_the_mask_equals_transformers_assistant_mask_on_a_marked_template(tokenizer: Any) -> None:
    """The same template with {% generation %} markers: transformers' own mask over the whole rendering
    marks the same tokens (the markers do not change the text)."""
    plain = assistant_tokens(tokenizer, CONVERSATION[:5])
    tokenizer.chat_template = MARKED
    marked = assistant_tokens(tokenizer, CONVERSATION[:5])
    theirs = tokenizer.apply_chat_template(CONVERSATION[:5], tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
    assert marked == plain
    assert theirs["input_ids"][: len(plain.token_ids)] == plain.token_ids
    assert [bool(m) for m in theirs["assistant_masks"][: len(plain.mask)]] == plain.mask
    assert not any(theirs["assistant_masks"][len(plain.mask):])  # the template's last newline


def test_conversations_too_long_or_that_a_template_cannot_split_are_named_by_line(tokenizer: Any) -> None:
    lines = [
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',
        '{"messages": [{"role": "user", "content": "' + "word " * 300 + '"}, {"role": "assistant", "content": "x"}]}',
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
        '{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}',
    ]
    demonstrations = read_demonstrations("\n".join(lines).encode())
    kept, bad = tokenize_demonstrations(tokenizer, demonstrations, max_seq_tokens=256)
    assert len(kept) == 2 and [(v.field, v.description) for v in bad] == [
        ("prompts[line 2]", "333 tokens through the chat template, more than sft.max_seq_tokens (256)")]
    # a template that re-renders earlier turns (here: it counts the messages up front) cannot be split
    tokenizer.chat_template = "{{ messages | length }}" + tokenizer.chat_template
    _, bad = tokenize_demonstrations(tokenizer, demonstrations, max_seq_tokens=256)
    assert [v.field for v in bad] == [f"prompts[line {n}].messages[1]" for n in (1, 2, 3)]
    assert "renders the turns before this assistant message differently" in bad[0].description
    tokenizer.chat_template = None
    assert [v.field for v in tokenize_demonstrations(tokenizer, demonstrations, 256)[1]] == ["model"]
    with pytest.raises(ConversationError, match="no chat template"):
        assistant_tokens(tokenizer, CONVERSATION)
