"""The rollout engine's configuration: `EngineConfig` (batching, prompts, the paged KV cache's
geometry) and `SpecConfig` (adaptive speculative decoding). The cache geometry has one owner:
`cache_len` (a row's slots at its longest), `row_pages` (a page table's width) and `pool_pages`
(a replica's pool) are read from here by the engine, the page allocator and the memory plan,
and slots become pages by `models.pages_for` only."""

from __future__ import annotations

import dataclasses

from tlt_jax.errors import ConfigError
from tlt_jax.models import pages_for
from tlt_jax.rollout.scheduler import bucket_for, kv_bucket
from tlt_jax.rollout.policies.strategy import DEFAULT_ARM, Strategy


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Adaptive speculative decoding: on once the live batch stays <= bs_threshold for
  `patience` consecutive chunk checks (then on for the rest of the generate call); with a
  speculation gate, only at the batch buckets it opens (gate.py: where the payoff is)."""

  strategy: Strategy = DEFAULT_ARM  # an arm (strategy.py; a name is parsed), e.g. "4_1_5", "off"
  # a cap on the live batch speculation may run at (0: none, up to max_batch): with a gate,
  # where speculation pays is measured, not set; a user may still cap it
  bs_threshold: int = 0
  patience: int = 2
  use_kernel: bool | None = None  # Pallas verification kernel vs jnp reference; None: GPU only
  # Compile the speculative executables in a background thread from the first generate on;
  # speculation starts at a bucket once one arm choosable there is compiled, its chunks
  # choosing among the compiled ones (until then the rows decode plainly): no chunk waits for
  # a compile, the bandit sees no compile time, and on an accelerator host the compiles
  # overlap decoding for free. Off: each executable compiles on first use (speculation from
  # the first generate call).
  background_compile: bool = False
  max_steps: int = 0  # catch-up capacity (>= every strategy's steps); 0 -> the strategies'

  def __post_init__(self):
    try:
      object.__setattr__(self, "strategy", Strategy(self.strategy))
    except ValueError as e:
      raise ConfigError(str(e), "strategy", self.strategy) from None
    if self.bs_threshold < 0:
      raise ConfigError("must be >= 0 (0: no cap)", "bs_threshold", self.bs_threshold)
    if self.patience < 1:
      raise ConfigError("must be >= 1", "patience", self.patience)
    if self.max_steps < 0:
      raise ConfigError("must be >= 0", "max_steps", self.max_steps)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_batch: int = 64  # rows decoded at once by one worker
  buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # batch sizes compiled for
  chunk_size: int = 16  # decode steps between host checks (compaction / refill / metrics)
  compaction: bool = True  # shrink to the smallest bucket that holds the live rows
  # compile the plain executables of the buckets below a batch's on the engine's compile
  # thread while it decodes (rollout/plain_ahead.py): its tail does not stop to compile each
  compile_ahead: bool = False
  max_prompt_len: int = 128  # cache capacity is max_prompt_len + max_new_tokens
  max_new_tokens: int = 256
  prompt_bucket: int = 16  # prompts are padded to a multiple of this (fewer prefill compiles)
  # return per-token last-layer hidden states (drafter data); with a speculation gate, only
  # while it wants the drafter trained (none on hardware where drafts cannot pay)
  capture_hidden: bool = False
  hidden_keep: int = 0  # > 0: keep only each response's last hidden_keep states (host memory)
  stop_tokens: tuple[int, ...] = ()
  spec: SpecConfig | None = None  # speculative decoding (needs drafter params on the worker)
  page_size: int = 16  # KV slots per page of the paged cache
  # pages in the replica's KV pool; 0: max_batch rows of max length (admission never waits)
  kv_pages: int = 0
  # one qkv and one gate/up matmul a layer in the replicas' weights (models.fuse_projections);
  # None: on GPUs, where it measured faster (plain decode of the 1.13B bench target on one
  # H200: 2% at batch 1, 5% at batch 8), not on CPUs
  fused_projections: bool | None = None
  # attention over the cache reading each row's live pages (kernels/paged_attention.py: a
  # Pallas kernel on GPUs, the same loop in XLA elsewhere): one attention window, the whole
  # cache, so no executable is compiled per window (rollout/windows.py). None: paged on every
  # backend, on a GPU where the kernel serves the replica (`resolve_attention`: its limits and
  # a start-up check against the XLA form), else the windows. Measured: the main job 1.09x
  # faster on a CPU; on one H200 the kernel's decode step 0.97x / 0.98x / 1.08x of the windows'
  # at batch 1 / 8 / 64 (docs/gpu.md), where an RL step's second rollout compiled for 22.9 s
  # of its 26.8 s, mostly the windows' executables. Replicas resolve it when built: theirs
  # holds a bool.
  paged_attention: bool | None = None

  @property
  def spec_top(self) -> int:
    """The largest live batch speculation may run at: max_batch, or the spec's cap."""
    cap = self.spec.bs_threshold if self.spec is not None else 0
    return min(cap, self.max_batch) if cap else self.max_batch

  def __post_init__(self):
    if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) \
        or self.buckets[0] < 1:
      raise ConfigError("a strictly increasing tuple of batch sizes, e.g. (1, 2, 4, 8)",
                        "buckets", self.buckets)
    if self.max_batch < 1:
      raise ConfigError("must be >= 1", "max_batch", self.max_batch)
    if self.buckets[-1] < self.max_batch:
      raise ConfigError(f"the largest bucket must be >= max_batch ({self.max_batch})",
                        "buckets", self.buckets)
    for name in ("chunk_size", "max_prompt_len", "max_new_tokens", "prompt_bucket", "page_size"):
      if getattr(self, name) <= 0:
        raise ConfigError("must be > 0", name, getattr(self, name))
    if not isinstance(self.compile_ahead, bool):
      raise ConfigError("True or False", "compile_ahead", self.compile_ahead)
    if self.hidden_keep < 0:
      raise ConfigError("must be >= 0 (0 = all)", "hidden_keep", self.hidden_keep)
    if self.kv_pages and self.kv_pages < self.row_pages:
      raise ConfigError(f"a KV pool must hold one row of max_prompt_len + max_new_tokens = "
                        f"{self.cache_len} slots: >= {self.row_pages} pages of {self.page_size}"
                        " (0: max_batch such rows)", "kv_pages", self.kv_pages)

  @property
  def cache_len(self) -> int:
    return self.max_prompt_len + self.max_new_tokens

  @property
  def row_pages(self) -> int:
    """Pages of a row at its longest (a page table's width)."""
    return pages_for(self.cache_len, self.page_size)

  @property
  def pool_pages(self) -> int:
    """Pages of a replica's KV pool: kv_pages, or max_batch rows at their longest."""
    return self.kv_pages or self.max_batch * self.row_pages

  def fuses(self) -> bool:
    """Whether the replicas' weights are fused (`fused_projections`, resolved by backend)."""
    if self.fused_projections is not None:
      return self.fused_projections
    import jax
    return jax.default_backend() == "gpu"

  def reads_pages(self) -> bool:
    """Whether attention reads the rows' live pages (`paged_attention`; None: yes, on every
    backend, unless a GPU's check of the kernel falls back, `resolve_attention`)."""
    return self.paged_attention is not False

  def resolve_attention(self, cfg, tensor: int = 1) -> tuple["EngineConfig", str]:
    """This config with `paged_attention` a bool, for JAX's backend, the replica's model
    `cfg` and its `tensor`-parallel width, and the attention in words (the run's start-up
    line). Paged on a GPU (None) only where the kernel serves the replica
    (`paged_attention.gpu_verdict`), else the windows, with the reason."""
    import jax
    import jax.numpy as jnp
    from tlt_jax.kernels.paged_attention import default_impl, gpu_verdict
    pinned = {None: "rollout.attention=auto", True: "rollout.attention=paged",
              False: "rollout.attention=windows"}[self.paged_attention]
    if self.paged_attention is None and jax.default_backend() == "gpu":
      failed = gpu_verdict(cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim_,
                           self.page_size, jnp.dtype(cfg.compute_dtype).name, self.row_pages,
                           tensor)
      if failed:
        return (dataclasses.replace(self, paged_attention=False),
                f"attention windows, an executable per window ({pinned}: the paged kernel "
                f"{failed})")
    paged = self.reads_pages()
    if not paged:
      return self, f"attention windows, an executable per window ({pinned})"
    how = ("the Pallas (Triton) kernel" if default_impl() == "pallas" else "XLA's block loop")
    return (dataclasses.replace(self, paged_attention=True),
            f"paged attention: each row's live pages read in place by {how}, one window "
            f"({pinned})")

  def plans_paged(self, cfg, tensor: int = 1, *, gpu: bool) -> bool:
    """Whether a replica's attention will read each row's pages in place (the memory plan:
    no window gathered, no scores over it), as `resolve_attention` will decide, planned for a
    GPU (`gpu`) or not: a pinned setting; on this machine's GPU the kernel's check (cached
    for the replicas); for a GPU planned from elsewhere, the kernel's limits; else yes."""
    if self.paged_attention is not None or not gpu:
      return self.reads_pages()
    import jax
    from tlt_jax.kernels.paged_attention import kernel_limits
    if jax.default_backend() == "gpu":
      return bool(self.resolve_attention(cfg, tensor)[0].paged_attention)
    return kernel_limits(cfg.head_dim_, self.page_size) is None

  def window_for(self, need: int) -> int:
    """The attention window of a chunk whose rows reach `need` cache slots: the `kv_bucket`
    holding them; with paged attention the whole cache (its one window: the kernel reads the
    live pages)."""
    if self.reads_pages():
      return self.cache_len
    return kv_bucket(need, self.prompt_bucket, self.cache_len)

  def bucket_for(self, n: int) -> int:
    return bucket_for(self.buckets, n)
