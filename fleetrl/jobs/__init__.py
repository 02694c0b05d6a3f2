"""The job store: job records, their files and step metrics, and the learner's job lease, in Redis.

- `store`: `JobStore` and `JobRecord`; the fencing rule (`FENCE_LUA`) every write under a job lease
  carries. The gateway creates and cancels jobs, the learner claims them, actors read them.
"""
