"""The learner's side of an RL step: GRPO's clipped loss (`grpo.py`), the learner that steps it
(`learner.py`: `prepare` / `update` over packed micro-batches, LoRA's adapters), the group
advantages (`advantages.py`), its batches (`batching.py`),
reward functions (`rewards.py`) and the process pool that runs them (`reward_pool.py`,
`reward_worker.py`). It imports nothing of the rollout, the drafter, the coordinator or the
simulator (tests/test_tree.py checks it): the learner sees responses and rewards only, never
how they were decoded, which is why speculation cannot change what it learns."""
