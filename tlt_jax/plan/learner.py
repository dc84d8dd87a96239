"""The learner's phases of an RL step, priced for the cluster simulator (sim.py).

The learner's own batch layout (`Layout`: grpo's random partition into mini-batches and its
packed micro-batches, the padding left included), each micro-batch's forward FLOPs (`micro_flops`:
the weights', and the attention's over each row's [T, T] scores, half of them where a fused
kernel skips the masked half), and `learner_phases`: the log-prob pass, the update (one
optimizer step per mini-batch, FSDP's gathers) and the weight sync, at the efficiencies of a
`Learner`: assumed for a GPU cluster (docs/scale.md), fitted on the machine it runs on by
`calibrate.learner_profile`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tlt_jax.models import ModelConfig
from tlt_jax.models.config import DTYPE_BYTES
from tlt_jax.plan import cost


@dataclasses.dataclass(frozen=True)
class Learner:
  """What the learner's phases cost on the whole cluster: assumptions for a GPU cluster
  (docs/scale.md); on the machine it runs on, `calibrate.learner_profile` measures them."""
  gpus: int
  train_eff: float = 0.7  # the update's FLOP rate relative to the profile's matmul rate
  fwd_eff: float = 0.7  # the log-prob pass's
  # the update's forwards per micro-batch: 3 (forward, backward's two) plus what the backward
  # recomputes: "full" remat the whole forward (4), "dots" all but the matmuls (3 for the
  # weights, 4 for the attention, which it recomputes), "none" nothing (`remat_mode`)
  remat: str = "full"
  fwd_micro_s: float = 0.0  # s per micro-batch of the log-prob pass beyond its FLOPs
  train_micro_s: float = 0.0  # ... of the update (dispatch, the batch's transfer, the sync)
  optimizer_s: float | None = None  # s per optimizer step (None: AdamW's bytes at mem_bw)
  # the attention of packed rows through a fused flash-attention kernel (models/attention.py:
  # a GPU in bf16), which skips the causal mask's upper half, at attn_eff of the matmul rate
  # (assumed: FlashAttention-2-class kernels reach ~35% of an H100's bf16 peak; gpu_check's
  # learner stage measures ours). False: XLA's reference, the whole [T, T] at the update's or
  # the log-prob pass's own efficiency (a CPU).
  fused_attention: bool = True
  attn_eff: float = 0.35


@dataclasses.dataclass(frozen=True)
class Layout:
  """The learner's batch layout (config.grpo; batching.micro_layout's arguments)."""
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
    partition and packing (batching.minibatch_parts, batching.micro_layout)."""
    from tlt_jax.rl import batching
    return [[(n, t) for _, t, n in batching.micro_layout(
        [seq_lens[i] for i in part], self.micro_batch, self.pad_multiple, self.max_len,
        self.micro_batch_tokens, self.row_multiple)]
        for part in batching.minibatch_parts(len(seq_lens), self.minibatches, seed)]


def remat_mode(cfg: ModelConfig) -> str:
  """The learner's rematerialisation as `Learner.remat` spells it."""
  return cfg.remat_policy if cfg.remat else "none"


def weight_flops(cfg: ModelConfig, rows: int, t: int) -> float:
  """A forward's matmuls over rows x t tokens (padding included: the device computes it): 2
  FLOPs per weight per token."""
  return cost.forward(cfg, 1, 1, 0).flops * rows * t


def attention_flops(cfg: ModelConfig, rows: int, t: int, *, causal_skip: bool) -> float:
  """A forward's attention scores and values over each row's t x t matrix (within segments
  or not: the mask is applied per element), or its lower half where a fused kernel skips the
  blocks above the diagonal."""
  full = 4.0 * rows * t * t * cfg.num_heads * cfg.head_dim_ * cfg.num_layers
  return full / 2 if causal_skip else full


def micro_flops(cfg: ModelConfig, rows: int, t: int, *, causal_skip: bool = False) -> float:
  """One forward over a micro-batch of rows x t tokens: `weight_flops` + `attention_flops`."""
  return weight_flops(cfg, rows, t) + attention_flops(cfg, rows, t, causal_skip=causal_skip)


def learner_phases(cfg: ModelConfig, hw: cost.Hardware, learner: Learner,
                   shapes: Sequence[Sequence[tuple[int, int]]], *, reference: bool
                   ) -> dict[str, float]:
  """Seconds of the log-probs (old policy, and the reference with a KL term), the update
  (forward + backward of every micro-batch, one optimizer step per mini-batch, FSDP's
  gathers) and the weight sync (the new weights to every rollout replica) of one RL step,
  from the micro-batches' shapes (`Layout.shapes`). The old log-probs skip the first
  mini-batch (grpo.prepare: on policy, its loss reads its own)."""
  n_params = cost.forward(cfg, 1, 1, 0).flops / 2
  micro = [s for mb in shapes for s in mb]
  later = [s for mb in shapes[1:] for s in mb]
  fused = learner.fused_attention
  rate = hw.flops * learner.gpus

  def forward_s(micros, eff, w_passes=1, a_passes=1):  # forwards over these micro-batches
    w = sum(weight_flops(cfg, n, t) for n, t in micros)
    a = sum(attention_flops(cfg, n, t, causal_skip=fused) for n, t in micros)
    return (w_passes * w / (rate * eff)
            + a_passes * a / (rate * (learner.attn_eff if fused else eff)))

  nb = DTYPE_BYTES[cfg.dtype]
  gather = n_params * nb * (learner.gpus - 1) / max(learner.gpus, 1)  # one FSDP all-gather
  pass_s = lambda micros: (forward_s(micros, learner.fwd_eff)
                           + len(micros) * learner.fwd_micro_s + gather / hw.link_bw)
  logprobs = (pass_s(later) if later else 0.0) + (pass_s(micro) if reference else 0.0)
  w_passes = 4 if learner.remat == "full" else 3
  a_passes = 3 if learner.remat == "none" else 4
  opt = learner.optimizer_s
  if opt is None:
    opt = 16 * 2 * n_params / learner.gpus / hw.mem_bw  # f32 master, m, v, grads read + written
  update = (forward_s(micro, learner.train_eff, w_passes, a_passes)
            + len(micro) * learner.train_micro_s + len(shapes) * (3 * gather / hw.link_bw + opt))
  sync = n_params * nb * (learner.gpus - 1) / max(learner.gpus, 1) / hw.link_bw
  return {"logprobs": logprobs, "update": update, "weight_sync": sync}
