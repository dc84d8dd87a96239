"""Rewards to advantages, host-side: VeRL's critic-free estimators over each prompt's group of
responses (`grpo.adv_estimator`), and DAPO's soft overlong punishment added to the rewards
first. numpy, float64 inside; every token of a response carries its response's advantage.
"""

from __future__ import annotations

import numpy as np


def group_advantages(rewards: np.ndarray, *, eps: float = 1e-6, norm_by_std: bool = True
                     ) -> np.ndarray:
  """rewards [P, n] (n responses per prompt) -> advantages [P, n].

  A = (r - mean_group) / (std_group + eps), std with Bessel's correction (torch.std, as in
  VeRL). A group whose rewards are all equal carries no signal and gets A = 0.
  """
  r = np.asarray(rewards, np.float64)
  if r.ndim != 2:
    raise ValueError(f"rewards must be [prompts, n], got shape {r.shape}")
  centered = r - r.mean(axis=1, keepdims=True)
  if not norm_by_std:
    return centered.astype(np.float32)
  n = r.shape[1]
  std = r.std(axis=1, ddof=1, keepdims=True) if n > 1 else np.zeros_like(r[:, :1])
  return (centered / (std + eps)).astype(np.float32)


# grpo.adv_estimator: VeRL's critic-free estimators over a prompt's group of responses
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


def advantages(rewards: np.ndarray, lengths: np.ndarray, *, estimator: str = "grpo",
               eps: float = 1e-6, norm_by_std: bool = True) -> np.ndarray:
  """rewards, lengths [P, n] (the batch's groups, the responses' tokens) -> advantages [P, n]
  (every token of a response carries its response's), as VeRL computes them:
    grpo  `group_advantages` (norm_by_std False: Dr. GRPO's r - mean)
    rloo  the leave-one-out baseline: r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean)
    reinforce_plus_plus_baseline  r - the group's mean, then whitened over the batch's
          response tokens (mean and Bessel-corrected variance over tokens, 1e-8 under the
          root), so a response weighs as its length in the batch's statistics"""
  if estimator == "grpo":
    return group_advantages(rewards, eps=eps, norm_by_std=norm_by_std)
  r = np.asarray(rewards, np.float64)
  n = r.shape[1]
  centered = r - r.mean(axis=1, keepdims=True)
  if estimator == "rloo":
    return (centered * n / max(n - 1, 1)).astype(np.float32)
  if estimator != "reinforce_plus_plus_baseline":
    raise ValueError(f"advantages: unknown estimator {estimator!r}; use one of {ADV_ESTIMATORS}")
  w = np.asarray(lengths, np.float64)
  tokens = w.sum()
  if tokens <= 1:
    return np.zeros_like(r, np.float32)
  mean = (w * centered).sum() / tokens
  var = (w * (centered - mean) ** 2).sum() / tokens * tokens / (tokens - 1)
  return ((centered - mean) / np.sqrt(var + 1e-8)).astype(np.float32)


def overlong_penalty(lengths: np.ndarray, max_len: int, buffer: int, penalty: float = 1.0
                     ) -> np.ndarray:
  """DAPO's soft overlong punishment, added to the rewards: 0 for a response of at most
  max_len - buffer tokens, then falling linearly to -penalty at max_len tokens (a response is
  never longer: the rollout stops it there). buffer 0: none."""
  lengths = np.asarray(lengths, np.float64)
  if buffer <= 0:
    return np.zeros_like(lengths, np.float32)
  over = np.clip(lengths - (max_len - buffer), 0.0, buffer)
  return (-penalty * over / buffer).astype(np.float32)
