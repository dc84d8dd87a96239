"""The learner's phases of an RL step, priced for the cluster simulator (sim.py).

The learner's own batch layout (`Layout`: grpo's random partition into mini-batches and its
packed micro-batches, the padding left included), each micro-batch's forward FLOPs (`micro_flops`:
the weights', and the attention's: over each row's whole [T, T] scores in XLA's reference,
over its segments' causal pairs where the fused kernel visits only the blocks a segment
reaches), and `learner_phases`: the log-prob pass, the update (one
optimizer step per mini-batch, FSDP's gathers) and the weight sync, at the efficiencies of a
`Learner`: assumed for a GPU cluster (docs/scale.md), fitted on the machine it runs on by
`calibrate.learner_profile`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

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
  # the attention of packed rows through the fused flash-attention kernel (models/attention.py:
  # a GPU in bf16), which computes each segment's causal pairs (`Micro.pairs`), at attn_eff of
  # the profile's matmul rate: measured, our kernel's forward + backward at Qwen2.5-7B's heads
  # over 4 rows of 4096 tokens of long-tailed responses on one H200 took 2.42 ms, 0.62x the
  # speed the 0.35 assumed before would give (docs/gpu.md, 2026-12-04; gpu_check's learner
  # stage prints the ratio, `fused_attention_s`). False: XLA's reference, the whole [T, T]
  # at the update's or the log-prob pass's own efficiency (a CPU).
  fused_attention: bool = True
  attn_eff: float = 0.22


class Micro(NamedTuple):
  """A micro-batch's shape as the learner's attention sees it."""
  rows: int
  t: int  # the rows' padded length
  # the (query, key) pairs attention within segments computes: over its rows, the sum over
  # each row's segments (its padding tail one more, as the fused kernel treats it) of
  # l (l + 1) / 2
  pairs: int

  @classmethod
  def whole(cls, rows: int, t: int) -> "Micro":
    """Rows of one t-token segment each."""
    return cls(rows, t, rows * t * (t + 1) // 2)

  @classmethod
  def of(cls, segment_ids) -> "Micro":
    """The shape of a packed micro-batch from its [rows, T] segment ids."""
    import numpy as np
    seg = np.asarray(segment_ids)
    pairs = 0
    for row in seg:
      counts = np.unique(row, return_counts=True)[1].astype(np.int64)
      pairs += int(np.sum(counts * (counts + 1) // 2))
    return cls(seg.shape[0], seg.shape[1], pairs)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The learner's batch layout (config.grpo; batching.micro_layout's arguments)."""
  micro_batch: int
  micro_batch_tokens: int
  pad_multiple: int
  max_len: int
  minibatches: int
  row_multiple: int = 1
  max_rows: bool = False
  epochs: int = 1  # passes over the mini-batches (grpo.ppo_epochs)

  @classmethod
  def of(cls, cfg, row_multiple: int = 1, fused: bool = True) -> "Layout":
    """A run's layout (config.grpo); its row_layout "auto" as the run resolves it, given
    whether the packed attention is the fused kernel (run.learner_spec)."""
    g = cfg.grpo
    layout = g.get("row_layout", "auto")
    return cls(int(g.micro_batch), int(g.micro_batch_tokens), int(g.pad_multiple),
               int(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens), int(g.minibatches),
               row_multiple, layout == "max_len" or (layout == "auto" and fused),
               int(g.get("ppo_epochs", 1)))

  def shapes(self, seq_lens: Sequence[int], seed: int = 0) -> list[list[Micro]]:
    """Every micro-batch's `Micro`, per mini-batch: the learner's own partition and packing
    (batching.minibatch_parts, batching.micro_layout)."""
    from tlt_jax.rl import batching

    def micro(bins, t, n):  # bins: the global sample indices of each of the n rows
      lens = [[seq_lens[i] for i in b] for b in bins]
      return Micro(n, t, sum(x * (x + 1) // 2 for row in lens for x in [*row, t - sum(row)]))
    out = []
    for part in batching.minibatch_parts(len(seq_lens), self.minibatches, seed):
      lens = [seq_lens[i] for i in part]
      layout = batching.micro_layout(lens, self.micro_batch, self.pad_multiple, self.max_len,
                                     self.micro_batch_tokens, self.row_multiple,
                                     self.max_rows)
      out.append([micro([[part[i] for i in b] for b in bins], t, n) for bins, t, n in layout])
    return out


def remat_mode(cfg: ModelConfig) -> str:
  """The learner's rematerialisation as `Learner.remat` spells it."""
  return cfg.remat_policy if cfg.remat else "none"


def weight_flops(cfg: ModelConfig, rows: int, t: int) -> float:
  """A forward's matmuls over rows x t tokens (padding included: the device computes it): 2
  FLOPs per weight per token (a mixture of experts: each token's k experts')."""
  return cost.forward(cfg, 1, 1, 0).flops * rows * t


def attention_flops(cfg: ModelConfig, micro: Micro, *, fused: bool) -> float:
  """A forward's attention scores and values: over each row's whole t x t matrix in XLA's
  reference (the mask applied per element), over its segments' causal pairs in the fused
  kernel (kernels/flash_attention.py; block granularity ignored: the blocks hold 64-128
  tokens, the learner's segments hundreds to thousands)."""
  pairs = micro.pairs if fused else micro.rows * micro.t * micro.t
  return 4.0 * pairs * cfg.num_heads * cfg.head_dim_ * cfg.num_layers


def fused_attention_s(heads: int, head_dim: int, pairs: int, hw: cost.Hardware,
                      learner: Learner, passes: int = 3) -> float:
  """One layer's fused attention over `pairs` causal pairs on one device, as `learner_phases`
  prices it: `passes` forwards' FLOPs (3: a forward and its backward) at attn_eff of the
  profile's matmul rate. gpu_check's learner stage sets it beside the kernel's measured time
  (scripts/gpu_learner.py): their ratio is what attn_eff should be."""
  return passes * 4.0 * pairs * heads * head_dim / (hw.flops * learner.attn_eff)


def micro_flops(cfg: ModelConfig, micro: Micro, *, fused: bool = False) -> float:
  """One forward over a micro-batch: `weight_flops` + `attention_flops`."""
  return weight_flops(cfg, micro.rows, micro.t) + attention_flops(cfg, micro, fused=fused)


def learner_phases(cfg: ModelConfig, hw: cost.Hardware, learner: Learner,
                   shapes: Sequence[Sequence[Micro]], *, reference: bool, epochs: int = 1,
                   adapters: int = 0) -> dict[str, float]:
  """Seconds of the log-probs (old policy, and the reference with a KL term), the update
  (forward + backward of every micro-batch, one optimizer step per mini-batch, `epochs`
  passes over them: grpo.ppo_epochs; FSDP's gathers) and the weight sync (the new weights to
  every rollout replica) of one RL step, from the micro-batches' shapes (`Layout.shapes`).
  The old log-probs skip the first mini-batch where each steps once (rl/learner.prepare: on
  policy, its loss reads its own). adapters: LoRA's trained parameters (0: the whole model):
  the backward then computes no weight gradient (one weight pass fewer), reduce-scatters no
  gradient of the base, the optimizer steps the adapters alone, and the sync merges them
  into the base first (a read and a write of it)."""
  n_params = cost.model_weights(cfg)  # (every expert's: gathered, stepped)
  micro = [s for mb in shapes for s in mb]
  later = [s for mb in shapes[1 if epochs == 1 else 0:] for s in mb]
  fused = learner.fused_attention
  rate = hw.flops * learner.gpus

  def forward_s(micros, eff, w_passes=1, a_passes=1):  # forwards over these micro-batches
    w = sum(weight_flops(cfg, m.rows, m.t) for m in micros)
    a = sum(attention_flops(cfg, m, fused=fused) for m in micros)
    return (w_passes * w / (rate * eff)
            + a_passes * a / (rate * (learner.attn_eff if fused else eff)))

  nb = DTYPE_BYTES[cfg.dtype]
  gather = n_params * nb * (learner.gpus - 1) / max(learner.gpus, 1)  # one FSDP all-gather
  pass_s = lambda micros: (forward_s(micros, learner.fwd_eff)
                           + len(micros) * learner.fwd_micro_s + gather / hw.link_bw)
  logprobs = (pass_s(later) if later else 0.0) + (pass_s(micro) if reference else 0.0)
  w_passes = (4 if learner.remat == "full" else 3) - (1 if adapters else 0)
  a_passes = 3 if learner.remat == "none" else 4
  opt = learner.optimizer_s
  if opt is None:  # f32 master, m, v, grads read + written
    opt = 16 * 2 * (adapters or n_params) / learner.gpus / hw.mem_bw
  gathers = 2 if adapters else 3  # forward, backward (and the gradients' reduce-scatter)
  update = epochs * (forward_s(micro, learner.train_eff, w_passes, a_passes)
                     + len(micro) * learner.train_micro_s
                     + len(shapes) * (gathers * gather / hw.link_bw + opt))
  sync = n_params * nb * (learner.gpus - 1) / max(learner.gpus, 1) / hw.link_bw
  if adapters:
    sync += 2 * n_params * nb / learner.gpus / hw.mem_bw
  return {"logprobs": logprobs, "update": update, "weight_sync": sync}
