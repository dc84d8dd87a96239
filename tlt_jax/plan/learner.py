"""The learner's phases of an RL step, priced for the cluster simulator (sim.py).

The learner's own batch layout (`Layout`: grpo's random partition into mini-batches and its
length-bucketed micro-batches, padding included), each micro-batch's forward FLOPs
(`micro_flops`), and `learner_phases`: the log-prob pass, the update (one optimizer step per
mini-batch, FSDP's gathers) and the weight sync, at the efficiencies of a `Learner`: assumed
for a GPU cluster (docs/scale.md), fitted on the machine it runs on by
`calibrate.learner_profile`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tlt_jax.models import ModelConfig
from tlt_jax.plan import cost


@dataclasses.dataclass(frozen=True)
class Learner:
  """What the learner's phases cost on the whole cluster: assumptions for a GPU cluster
  (docs/scale.md); on the machine it runs on, `calibrate.learner_profile` measures them."""
  gpus: int
  train_eff: float = 0.7  # the update's FLOP rate relative to the profile's matmul rate
  fwd_eff: float = 0.7  # the log-prob pass's
  remat: bool = True  # the backward recomputes the forward (4 forwards of FLOPs, not 3)
  fwd_micro_s: float = 0.0  # s per micro-batch of the log-prob pass beyond its FLOPs
  train_micro_s: float = 0.0  # ... of the update (dispatch, the batch's transfer, the sync)
  optimizer_s: float | None = None  # s per optimizer step (None: AdamW's bytes at mem_bw)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The learner's batch layout (config.grpo; grpo.micro_layout's arguments)."""
  micro_batch: int
  micro_batch_tokens: int
  pad_multiple: int
  max_len: int
  minibatches: int
  row_multiple: int = 1

  @classmethod
  def of(cls, cfg, row_multiple: int = 1) -> "Layout":
    g = cfg.grpo
    return cls(int(g.micro_batch), int(g.micro_batch_tokens), int(g.pad_multiple),
               int(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens), int(g.minibatches),
               row_multiple)

  def shapes(self, seq_lens: Sequence[int], seed: int = 0) -> list[list[tuple[int, int]]]:
    """(rows, padded length) of every micro-batch, per mini-batch: the learner's own
    partition and packing (grpo.minibatch_parts, grpo.micro_layout)."""
    from tlt_jax.rl import grpo
    return [[(n, t) for _, t, n in grpo.micro_layout(
        [seq_lens[i] for i in part], self.micro_batch, self.pad_multiple, self.max_len,
        self.micro_batch_tokens, self.row_multiple)]
        for part in grpo.minibatch_parts(len(seq_lens), self.minibatches, seed)]


def micro_flops(cfg: ModelConfig, rows: int, t: int) -> float:
  """One forward over a micro-batch of rows x t tokens (padding included: the device computes
  it): 2 FLOPs per weight per token, and the attention's scores and values over the whole
  t x t matrix (the causal mask is applied, not skipped)."""
  n_params = cost.forward(cfg, 1, 1, 0).flops / 2  # 2 FLOPs per weight per token
  return (2.0 * n_params * rows * t
          + 4.0 * rows * t * t * cfg.num_heads * cfg.head_dim_ * cfg.num_layers)


def learner_phases(cfg: ModelConfig, hw: cost.Hardware, learner: Learner,
                   shapes: Sequence[Sequence[tuple[int, int]]], *, reference: bool
                   ) -> dict[str, float]:
  """Seconds of the log-probs (old policy, and the reference with a KL term), the update
  (forward + backward of every micro-batch, one optimizer step per mini-batch, FSDP's
  gathers) and the weight sync (the new weights to every rollout replica) of one RL step,
  from the micro-batches' shapes (`Layout.shapes`)."""
  n_params = cost.forward(cfg, 1, 1, 0).flops / 2
  micro = [s for mb in shapes for s in mb]
  fwd = sum(micro_flops(cfg, n, t) for n, t in micro)
  nb = cost._BYTES[cfg.dtype]
  gather = n_params * nb * (learner.gpus - 1) / max(learner.gpus, 1)  # one FSDP all-gather
  logprobs = (1 + reference) * (fwd / (hw.flops * learner.fwd_eff * learner.gpus)
                                + len(micro) * learner.fwd_micro_s + gather / hw.link_bw)
  passes = 4 if learner.remat else 3
  opt = learner.optimizer_s
  if opt is None:
    opt = 16 * 2 * n_params / learner.gpus / hw.mem_bw  # f32 master, m, v, grads read + written
  update = (passes * fwd / (hw.flops * learner.train_eff * learner.gpus)
            + len(micro) * learner.train_micro_s + len(shapes) * (3 * gather / hw.link_bw + opt))
  sync = n_params * nb * (learner.gpus - 1) / max(learner.gpus, 1) / hw.link_bw
  return {"logprobs": logprobs, "update": update, "weight_sync": sync}
