"""Long-tail rollout harness for strategy-selector comparisons (scripts/bench_mab.py and
notebooks/mab_bucket_ablation.ipynb share it, so both measure the same thing the same way).

Workload: the default task's test prompts on the default model and shipped drafter, sampled at
temperature 1 with EOS, so response lengths have the task's long tail. One worker serves every
selector: executables depend on (bucket, arm), not on who picks the arm, so after one
`precompile` every configuration runs without compiling, and handing each call another
selector is free. Speculation may switch on at any live size (bs_threshold = max_batch by
default), so every selector bucket is exercised.

Throughput of a pass = tokens / (wall time - compile time inside the pass): a prefill or
compaction shape first seen in a later pass must not count against whichever selector ran it.
Configurations run interleaved pass by pass, so drifting load on a shared machine hits all of
them alike; bandits keep their state across passes (as across RL steps).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from tlt_jax.rollout.config import EngineConfig, SpecConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sources.history import HistoryIndex
from tlt_jax.rollout.policies.cells import PolicyCells, make_selector
from tlt_jax.rollout.policies.mab import bandit_config
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.policies.strategy import Strategy
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.scheduler import buckets_upto


@dataclasses.dataclass
class Workload:
  cfg: Any  # ModelConfig
  params: Any
  drafter_params: Any
  requests: list[Request]
  stop_tokens: tuple[int, ...]
  max_prompt_len: int


def load_default_workload(num_prompts: int) -> Workload:
  """The default model, its drafter, and the first `num_prompts` test prompts."""
  from tlt_jax.bench.bench_model import load_target
  cfg, params, dparams, _, stop, prompts = load_target()
  prompts = prompts[:num_prompts]
  return Workload(cfg, params, dparams, [Request(p, i) for i, p in enumerate(prompts)], stop,
                  -(-max(len(p) for p in prompts) // 16) * 16)


class LongTailBench:
  """One speculative worker over a workload; its catch-up room fits every arm, so states and
  executables are shared by all selectors."""

  def __init__(self, w: Workload, arms: Sequence[str], *, max_batch: int, chunk_size: int,
               max_new_tokens: int, bs_threshold: int | None = None, temperature: float = 1.0):
    self.arms = list(arms)
    self.requests = w.requests
    self.sp = SamplingParams(temperature=temperature)
    spec = SpecConfig(strategy=self.arms[0], bs_threshold=bs_threshold or max_batch, patience=1,
                      use_kernel=jax.default_backend() == "gpu",  # CPU: the jnp reference
                      max_steps=max(Strategy(a).steps for a in self.arms))
    ecfg = EngineConfig(max_batch=max_batch, buckets=buckets_upto(max_batch),
                        chunk_size=chunk_size, max_prompt_len=w.max_prompt_len,
                        max_new_tokens=max_new_tokens, stop_tokens=w.stop_tokens, spec=spec)
    history = any(Strategy(a).history for a in self.arms)
    self.worker = Engine(w.params, w.cfg, ecfg, drafter_params=w.drafter_params,
                         bandit=bandit_config("eg", self.arms),
                         history=HistoryIndex() if history else None)

  def precompile(self) -> float:
    """Compiles every arm at every bucket speculation can run at, then one untimed pass
    compiles the prefill / compaction shapes. Returns the seconds spent."""
    t0 = time.perf_counter()
    self.worker.precompile(self.sp)
    self.worker.generate(self.requests, self.sp, seed=10_000,
                         policies=PolicyCells(make_selector("eg", self.arms)))
    return time.perf_counter() - t0

  def run(self, configs: dict[str, Callable[[], Any]], passes: int, *, seed: int = 0,
          log: Callable[[str], None] | None = None) -> tuple[list[Pass], dict[str, Any]]:
    """Runs every configuration (name -> selector factory) for `passes` passes, interleaved;
    pass i uses sampling seed seed + i for every configuration. Returns (passes, selectors)."""
    w = self.worker
    selectors = {name: make() for name, make in configs.items()}
    out: list[Pass] = []
    for i in range(passes):
      for name, sel in selectors.items():
        w.chunk_log.clear()
        compiled = sum(r.seconds for r in w.compile_log)
        t0 = time.perf_counter()
        res = w.generate(self.requests, self.sp, seed=seed + i, policies=PolicyCells(sel))
        dt = time.perf_counter() - t0 - (sum(r.seconds for r in w.compile_log) - compiled)
        p = Pass(name, i, sum(r.num_tokens for r in res), dt, list(w.chunk_log))
        out.append(p)
        if log:
          log(f"pass {i} {name}: {p.tokens} tokens in {p.seconds:.2f}s = "
              f"{p.tokens_per_s:.0f} tokens/s")
    return out, selectors

  def pair_memory(self) -> dict[tuple[str, int], tuple[int | None, float]]:
    """(arm, bucket) -> (memory_analysis bytes, compile seconds) of compiled spec executables
    (of a pair's widest attention window, the largest)."""
    recs = sorted((r for r in self.worker.compile_log if r.name == "spec"),
                  key=lambda r: r.key.variant[3])
    return {(r.key.variant[0], r.batch): (r.memory_bytes, r.compile_s) for r in recs}


@dataclasses.dataclass
class Pass:
  config: str
  index: int
  tokens: int
  seconds: float  # wall time minus compile time inside the pass
  chunks: list  # ChunkMetrics of the pass

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / max(self.seconds, 1e-9)


def throughput(passes: Sequence[Pass], config: str, skip: int = 0) -> tuple[float, float]:
  """(tokens/s over the config's passes after the first `skip`, spread = std of per-pass
  tokens/s)."""
  ps = [p for p in passes if p.config == config and p.index >= skip]
  tps = [p.tokens_per_s for p in ps]
  return sum(p.tokens for p in ps) / sum(p.seconds for p in ps), float(np.std(tps))
