"""Evaluation of a policy on held-out prompts.

- `result`: `EvalResult`, the one result of every evaluation (held-out pass@k, the addition check,
  a job's episodes).
- `passk`: greedy and sampled completions scored by the reward service, and the unbiased pass@k
  estimator; `fleetrl eval` and the learner's `eval.interval` both call it.
- `heldout`: `HeldOutEval`, the learner's held-out measure between steps.
- `addition`: the demo's addition task (greedy accuracy, number-only rate, pass@k).
"""
