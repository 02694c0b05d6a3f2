"""The policy: models and tokenizers, how they generate, and their log-probs.

- `models`: loading (built-in names, tiny test models, HF directories and hub ids), export, the
  operator's allow-list check, publishable state dicts.
- `backends`: the `Backend` Protocol, the transformers sampler (`HFBackend`) and `make_backend`;
  the chat template's rendering of prompts and observations. `vllm_backend`: the same on vLLM.
- `chat_escape`: environment text that can never become a special token.
- `logprobs`: target-token log-probs and entropies in chunks, without a full-vocabulary copy.
- `lora`: LoRA adapters on a frozen base (PEFT) for training.

Actors generate with a backend, the learner computes log-probs; neither is referenced from here.
"""
