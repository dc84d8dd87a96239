"""The learner's samples of a step's scored responses: the rewards the group advantages are
computed from (the reward function's plus DAPO's overlong penalty), the groups that carry
signal, and which responses train (DAPO's dynamic sampling and overlong filtering).

A response here is anything with `request_id` (its prompt's index among the step's),
`sample_index`, `prompt_ids`, `response_ids`, `num_tokens`, `finish_reason` and `reward`,
and optionally `logprobs`, the rollout's per token (tlt_jax/step_rollouts.py's `Response`)."""

from __future__ import annotations

from typing import Any, Sequence

import ml_collections
import numpy as np

from tlt_jax.rl import advantages, batching


def _tables(responses: Sequence[Any], num_prompts: int, n: int
            ) -> tuple[np.ndarray, np.ndarray]:
  """-> (rewards, lengths), each [prompts, n]."""
  r = np.zeros((num_prompts, n), np.float32)
  length = np.zeros_like(r)
  for res in responses:
    r[res.request_id, res.sample_index] = res.reward
    length[res.request_id, res.sample_index] = res.num_tokens
  return r, length


def _shaped(responses: Sequence[Any], num_prompts: int, cfg: ml_collections.ConfigDict
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """-> (rewards, DAPO's overlong penalty, lengths), each [prompts, n]."""
  r, length = _tables(responses, num_prompts, cfg.grpo.n)
  return r, advantages.overlong_penalty(length, cfg.rollout.max_new_tokens,
                                  cfg.reward.overlong_buffer,
                                  cfg.reward.overlong_penalty), length


def shaped_rewards(responses: Sequence[Any], num_prompts: int,
                   cfg: ml_collections.ConfigDict) -> tuple[np.ndarray, np.ndarray]:
  """-> (rewards [prompts, n], DAPO's overlong penalty [prompts, n]: 0 where
  reward.overlong_buffer is): what the group advantages are computed from, summed."""
  return _shaped(responses, num_prompts, cfg)[:2]


def signal_groups(responses: Sequence[Any], num_prompts: int, cfg: ml_collections.ConfigDict
                  ) -> np.ndarray:
  """[prompts] bool: the groups whose shaped rewards are not all equal (the others' advantages
  are all 0: no policy gradient)."""
  r, penalty = shaped_rewards(responses, num_prompts, cfg)
  return np.ptp(r + penalty, axis=1) > 0


def learner_samples(responses: Sequence[Any], num_prompts: int,
                    cfg: ml_collections.ConfigDict
                    ) -> tuple[np.ndarray, np.ndarray, list[batching.Sample], np.ndarray]:
  """-> (rewards [prompts, n], DAPO's overlong penalty [prompts, n], the learner's samples,
  the groups they come from): the advantages (grpo.adv_estimator, `advantages.advantages`) of the
  rewards plus the penalty over the groups that train: every one, or with grpo.filter_groups
  the first grpo.num_prompts groups with signal (DAPO's dynamic sampling); without the
  responses cut at the budget where grpo.drop_truncated (DAPO's overlong filtering: their
  group's advantages, and a batch's whitening, still count them)."""
  g = cfg.grpo
  r, penalty, length = _shaped(responses, num_prompts, cfg)
  groups = np.arange(num_prompts)
  if g.filter_groups:
    groups = np.flatnonzero(np.ptp(r + penalty, axis=1) > 0)[:g.num_prompts]
  adv = np.zeros_like(r)
  adv[groups] = advantages.advantages((r + penalty)[groups], length[groups],
                                estimator=g.get("adv_estimator", "grpo"), eps=g.adv_eps,
                                norm_by_std=g.norm_adv_by_std)
  train = set(groups.tolist())
  samples = [batching.Sample(res.prompt_ids, res.response_ids,
                             float(adv[res.request_id, res.sample_index]),
                             getattr(res, "logprobs", None))
             for res in responses if res.request_id in train
             and not (g.drop_truncated and res.finish_reason == "length")]
  return r, penalty, samples, groups
