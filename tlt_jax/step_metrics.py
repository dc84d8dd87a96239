"""What one RL step reports (a record of metrics.jsonl, TensorBoard's scalars), assembled from
the step's parts: its prompts and scored responses, the rollout's chunks and timeline summary,
the learner's update metrics, and the run's engines, gate, buffer and drafter; and the
drafter's acceptance on the step's own responses (`drafter_acceptance`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from tlt_jax import distributed
from tlt_jax.coordinator.timeline import merge_processes
from tlt_jax.eval import length_stats
from tlt_jax.rl.rewards import extra_means
from tlt_jax.rollout.executables import summary as executables_summary
from tlt_jax.rollout.records import by_kind, tokens_per_verification


def step_metrics(run, prompts: Sequence[Any], responses: Sequence[Any], r: np.ndarray,
                 chunks: Sequence[Any], walls: Sequence[float], upd: dict[str, Any],
                 reward_stats: Any,
                 spot: dict[str, Any], drafter: dict[str, Any] | None, *, epoch: int,
                 gate: Any = None, compiles: dict[str, Any] | None = None) -> dict[str, Any]:
  """The step's metrics, without its times. run: tlt_jax.run.Run; r: [prompts, n] rewards;
  walls: each rollout's seconds (several with grpo.filter_groups: the responses' `rollout`
  says whose); spot: the timeline's summary; drafter: the merge's metrics;
  epoch: the data's after this step's prompts; gate: the speculation gate's state after the
  rollout (None: no gate); compiles: the job's `executables.summary` (None: this process's
  engines')."""
  lengths = [res.num_tokens for res in responses]
  tokens = int(sum(lengths))
  spec_chunks = [c for c in chunks if c.mode != "plain"]
  drafted = [c for c in spec_chunks if c.mode != "off"]  # "off" verifies no drafts
  m: dict[str, Any] = {
      "reward": float(r.mean()),
      "accuracy": float((r >= 1.0).mean()),
      "solved_groups": float((r.max(axis=1) >= 1.0).mean()),
      "zero_adv_groups": float((r.std(axis=1) == 0).mean()),
      "response_length": length_stats(lengths),
      "truncated": float(np.mean([res.finish_reason == "length" for res in responses])),
      "rollout_tokens_per_s": tokens / max(sum(walls), 1e-9),
      "rollout_tail": _tail_of_rollouts(responses, walls),
      "tokens": tokens,
      "loss": upd,
      "reward_stats": dataclasses.asdict(reward_stats),
      "epoch": epoch,
  }
  extra = extra_means(getattr(res, "reward_extra", None) for res in responses)
  if extra:  # a verl-style reward's numbers (its dict's entries besides "score")
    m["reward_extra"] = extra
  sources = {p.row.source for p in prompts if p.row.source is not None}
  if sources:
    m["accuracy_by_source"] = {
        src: float(np.mean([r[i] >= 1.0 for i, p in enumerate(prompts) if p.row.source == src]))
        for src in sorted(sources)}
    m["prompts_by_source"] = {  # (a mixture's draws, data.train_weights, step by step)
        src: sum(p.row.source == src for p in prompts) for src in sorted(sources)}
  if spec_chunks:
    arms: dict[str, int] = {}
    for c in spec_chunks:
      arms[c.mode] = arms.get(c.mode, 0) + 1
    engines = run.coordinator.engines
    m["spec"] = {"chunks": len(spec_chunks), "arm_chunks": arms,
                 # mean accepted drafts + 1 over the chunks that drafted (not "off")
                 "tokens_per_verify": tokens_per_verification(drafted) or 0.0,
                 "share_of_tokens": sum(c.tokens for c in spec_chunks) / max(tokens, 1),
                 # Which verification ran ("pallas" kernel or "jnp" reference; a kernel
                 # that failed to compile fell back, see the run's log).
                 "verify_path": sorted({e.compiles.verify_path for e in engines}),
                 "kernel_fallbacks": sum(e.compiles.kernel_error is not None
                                         for e in engines),
                 "by_kind": by_kind(spec_chunks, tokens)}
  histories = [e.history.stats() for e in run.coordinator.engines if e.history is not None]
  if histories:
    m["history"] = {k: sum(h[k] for h in histories)
                    for k in ("memory_bytes", "sequences", "tokens", "lookups", "hits")}
  if gate is not None:
    m["spec_gate"] = gate.summary()
  m["executables"] = compiles if compiles is not None else local_compiles(run)
  # rows preempted for KV pages so far (resumed from the tokens they had: pages.py): a pool
  # that keeps preempting is smaller than the rows it admits need (rollout.kv_pages)
  m["preempted"] = {"rows": sum(e.preemptions for e in run.coordinator.engines),
                    "tokens": sum(e.preempted_tokens for e in run.coordinator.engines)}
  if run.coordinator.spot.mode != "off":
    m["spot"] = {k: v for k, v in spot.items() if k != "per_worker"}
    m["spot"]["per_worker"] = {str(p["worker"]): {k: v for k, v in p.items() if k != "worker"}
                               for p in spot["per_worker"]}
    m["spot"]["buffer_tokens"] = run.buffer.tokens
    if drafter:
      m["drafter"] = drafter
  return m


def local_compiles(run) -> dict[str, Any]:
  """`executables.summary` of this process's engines' compiles."""
  return executables_summary([r for e in run.coordinator.engines for r in e.compile_log])


def job_views(chunks, spot, timeline_json, reward_stats, compiles):
  """This process's chunk records, timeline (summary, JSON), reward-pool counts and compiles'
  summary -> the job's, from every process: the chunks, counts and compiles together, the
  timelines merged (`merge_processes`). A collective: every process calls it."""
  parts = distributed.all_gather_objects((list(chunks), spot, timeline_json, reward_stats,
                                          compiles))
  spot, timeline_json = merge_processes([(s, t) for _, s, t, _, _ in parts])
  stats = [p[3] for p in parts]
  total = dataclasses.replace(stats[0], **{
      f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(stats[0])})
  every = {k: round(sum(p[4][k] for p in parts), 2) for k in compiles}
  return [c for p in parts for c in p[0]], spot, timeline_json, total, every


def progress_fields(m: dict[str, Any], gate: Any = None) -> dict[str, str]:
  """A step's metrics as the progress bar shows them (gate: the train state's after it)."""
  post = {"reward": f"{m['reward']:.3f}", "len": f"{m['response_length']['mean']:.0f}",
          "s/step": f"{m['time']['total']:.1f}"}
  if gate is not None and not gate.drafter_wanted():
    post["drafter"] = "paused"  # (the gate found no draft pays here, or not yet)
  elif "spot" in m and m["spot"]["idle_share_trained"] is not None:
    post["idle_trained"] = f"{m['spot']['idle_share_trained']:.0%}"
  if m.get("drafter_acceptance", {}).get("tokens_per_verify") is not None:
    post["draft_tpv"] = f"{m['drafter_acceptance']['tokens_per_verify']:.2f}"
  if "eval" in m:
    post["eval_acc"] = f"{m['eval']['accuracy']:.3f}"
  return post


def _tail_of_rollouts(responses: Sequence[Any], walls: Sequence[float]) -> dict[str, float]:
  """`tail_share` of each of a step's rollouts: the time share weighted by its seconds, the
  token share by its tokens (the step's tail tokens over the step's tokens)."""
  if len(walls) == 1:
    return tail_share(responses)
  mine = [[r for r in responses if r.rollout == k] for k in range(len(walls))]
  parts = [tail_share(rs) for rs in mine]
  tokens = [sum(r.num_tokens for r in rs) for rs in mine]
  return {"time_share": sum(p["time_share"] * w for p, w in zip(parts, walls))
          / max(sum(walls), 1e-9),
          "token_share": sum(p["token_share"] * t for p, t in zip(parts, tokens))
          / max(sum(tokens), 1)}


def tail_share(responses: Sequence[Any], frac: float = 0.1) -> dict[str, float]:
  """The long tail's share of a rollout, as reasoning-RL papers report it: the share of the
  rollout's time (its last response's finish) spent after all but the last `frac` of the
  responses had finished, and those responses' share of the tokens (finish times: seconds
  since each worker's generate began, the workers starting together)."""
  if not responses:
    return {"time_share": 0.0, "token_share": 0.0}
  done = sorted(responses, key=lambda r: r.finish_time)
  head = done[:max(int(np.ceil((1 - frac) * len(done))), 1)]
  end, t_head = done[-1].finish_time, head[-1].finish_time
  tokens = sum(r.num_tokens for r in done)
  return {"time_share": (end - t_head) / end if end > 0 else 0.0,
          "token_share": sum(r.num_tokens for r in done[len(head):]) / tokens if tokens else 0.0}


class DrafterAcceptance:
  """Tokens per verification of a chain of `config.tlt.drafter.acceptance_depth` drafts by
  the drafter that drafted a rollout on `acceptance_sample` of its responses (each read up to
  `data.max_prompt_len + acceptance_response_len` tokens, prompt included), at the rollout's
  sampling settings, read off their tokens with the policy that wrote them
  (tlt_jax/drafter/acceptance.py: no decoding; the engine's figure in expectation on the policy's
  own samples, exactly for greedy ones).

  Its one executable is compiled on a low-priority background thread from the first
  `prepare` (called as a rollout starts), so the first step's metric does not put a compile
  on the critical path. cfg: the run's config; learner: its learner.LearnerSpec (the policy's
  model config and mesh); sampling: the rollout's."""

  def __init__(self, cfg, learner, sampling):
    self.learner, self.sampling = learner, sampling
    d = cfg.tlt.drafter
    self.depth = int(d.acceptance_depth)
    # one length for every sequence (one executable), past the longest prompt
    self.length = int(cfg.data.max_prompt_len) + int(d.acceptance_response_len)
    self.sample = min(int(d.acceptance_sample), cfg.grpo.num_prompts * cfg.grpo.n)
    # the drafter goes beside the learner's params (the workers' store may span other devices)
    self._replicated = jax.sharding.NamedSharding(learner.mesh, jax.sharding.PartitionSpec())
    self._exe = None

  def prepare(self, params, dparams) -> None:
    """Starts compiling the executable (once) for these params' shapes and shardings."""
    if self._exe is not None:
      return
    from tlt_jax.drafter import acceptance
    from tlt_jax.rollout.executables import background_compiler
    compiler = background_compiler("compile-acceptance")
    dabs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated), dparams)
    self._exe = compiler.submit(
        acceptance.compile_survival, params, dabs, self.sample, self.length,
        cfg=self.learner.cfg, depth=self.depth, sampling=self.sampling)
    compiler.shutdown(wait=False)  # the thread ends with its one job

  def __call__(self, params, dparams, responses: Sequence[Any], *, seed: int
               ) -> dict[str, Any]:
    """The metric on `responses` (the sample a function of `seed`, the same on every
    process)."""
    from tlt_jax.drafter import acceptance
    n = min(self.sample, len(responses))
    pick = sorted(np.random.default_rng([seed, 29]).choice(len(responses), n, replace=False))
    seqs = [(responses[i].prompt_ids, responses[i].response_ids) for i in pick]
    exe = None if self._exe is None else self._exe.result()
    # every sequence cut to (and padded to) its first `length` tokens: one executable
    out = acceptance.measure(params, jax.device_put(dparams, self._replicated), seqs,
                             cfg=self.learner.cfg,
                             depth=self.depth, sampling=self.sampling,
                             length=self.length, executable=exe)
    return {"tokens_per_verify": out["tokens_per_verify"], "stderr": out["stderr"],
            "sequences": out["sequences"], "depth": self.depth, "length": self.length,
            "accepted_per_position": out["accepted_per_position"]}
