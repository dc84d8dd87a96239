"""A step's rollouts, the records the rest of the step reads (`Response`, `Rollouts`), and
the seed each rollout draws from: the coordinator's rollout (its workers decode, spot-train
when idle) with each response scored by the reward pool as it finishes, and with
grpo.filter_groups (DAPO's dynamic sampling) more rollouts while too few groups carry signal.
train.py's `rl_step` calls `rollouts`; the learner (rl/) reads the `Response`s, never how they
were decoded."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from tlt_jax import distributed
from tlt_jax.coordinator import Worker
from tlt_jax.eval import response_record
from tlt_jax.rl.reward_pool import RewardPool
from tlt_jax.rl.samples import signal_groups
from tlt_jax.rollout.policies.cells import Policies
from tlt_jax.rollout.records import Request, Result
from tlt_jax.run import Run, TrainState


def seed_for(seed: int, step: int) -> int:
  """Rollout seed of a step: a pure function of (seed, step), so resume needs no RNG state."""
  return int(np.random.default_rng([seed, step, 17]).integers(0, 2**31 - 1))


class Response(NamedTuple):
  """One scored response, as the advantages, the learner and the metrics read it (every
  process's, after the gather)."""

  request_id: int  # its prompt's index among the step's (every rollout's, in order)
  sample_index: int
  prompt_ids: np.ndarray
  response_ids: np.ndarray
  num_tokens: int
  finish_reason: str
  reward: float = 0.0  # (until scored)
  finish_time: float = 0.0  # seconds since its worker's generate began (the tail metric)
  rollout: int = 0  # which of the step's rollouts (grpo.filter_groups) wrote it
  reward_extra: dict | None = None  # the rest of a verl-style reward's dict (rewards.py)
  logprobs: np.ndarray | None = None  # [R] the rollout's, per token (rl/mismatch.py)

  @classmethod
  def of(cls, res: Result, rollout: int = 0) -> "Response":
    return cls(res.request_id, res.sample_index, res.prompt_ids, res.response_ids,
               res.num_tokens, res.finish_reason, finish_time=res.finish_time, rollout=rollout,
               logprobs=res.logprobs)


class Rollouts(NamedTuple):
  """A step's rollouts (one, or several with grpo.filter_groups) and what they left."""

  prompts: list  # every rollout's prompts, in order (a Response's request_id indexes them)
  responses: list[Response]  # every process's, scored, by (request_id, sample_index)
  data: Any  # the data position after the last rollout's prompts
  policies: Policies  # the bandit's and the gate's states after the last rollout
  chunks: list
  walls: list[float]  # each rollout's seconds until its barrier
  timelines: list  # each rollout's Timeline
  settles: list  # each rollout's settle(): its drafter's metrics once merged (module docstring)
  reward_wait: float  # seconds waited for rewards after the rollouts' barriers


def rollouts(run: Run, state: TrainState, pool: RewardPool, seed: int) -> Rollouts:
  """The step's rollouts from the train state's policies, rewards scored as responses
  finish (the coordinator keeps their drafter data; spot training when idle). With
  grpo.filter_groups (DAPO's dynamic sampling) each rollout draws grpo.gen_prompts prompts
  (0: grpo.num_prompts), and another rolls out, with the same policy, while fewer than
  grpo.num_prompts groups have signal (`signal_groups`), at most grpo.max_rollouts in all;
  each rollout's seed is a function of (seed, its index)."""
  cfg, g = run.cfg, run.cfg.grpo
  prompts: list = []
  responses: list[Response] = []
  data, policies = state.data, state.policies
  chunks, walls, timelines, settles, waited = [], [], [], [], 0.0
  rounds = g.max_rollouts if g.filter_groups else 1
  draw = g.gen_prompts or g.num_prompts
  release = cfg.memory.release_rollout_weights
  for k in range(rounds):
    batch, data = run.stream.batch(data, draw)
    offset = len(prompts)
    prompts += batch
    requests = [Request(p.ids, request_id=offset + i, sample_index=s)
                for i, p in enumerate(batch) for s in range(g.n)]

    def on_response(worker: Worker, res: Result) -> None:
      text = run.tokenizer.decode(res.response_ids, skip_special_tokens=True)
      row = prompts[res.request_id].row
      pool.submit((res.request_id, res.sample_index), text, row.answer, row.source,
                  row.extra_info)

    # (release: the workers free their actor copy for the learner's phases; a rollout that
    # may have a successor keeps it, released below where it is the last)
    out = run.coordinator.rollout(requests, run.sampling,
                                  seed=seed if k == 0 else seed_for(seed, k), step=state.step,
                                  on_response=on_response, policies=policies,
                                  release_actor=release and k == rounds - 1)
    policies = out.policies
    mine = [Response.of(res, k) for res in out.results]
    chunks += out.chunks
    walls.append(out.wall)
    timelines.append(out.timeline)
    settles.append(out.settle)
    del out  # the Results' hidden states go now (the buffer copied the windows it keeps)
    t = time.perf_counter()
    extras: dict = {}
    rewards = pool.gather([(res.request_id, res.sample_index) for res in mine], extras)
    waited += time.perf_counter() - t
    # every process's responses and rewards (each scored its own): the learner's batch is
    # global, and so is the decision to roll out again
    responses += gather_responses(
        [res._replace(reward=rewards[key], reward_extra=extras.get(key))
         for res in mine for key in [(res.request_id, res.sample_index)]])
    if k < rounds - 1 and signal_groups(responses, len(prompts), cfg).sum() >= g.num_prompts:
      if release:
        run.coordinator.release_actors()
      break
  return Rollouts(prompts, responses, data, policies, chunks, walls, timelines, settles,
                  waited)


def logged_responses(prompts: list, responses: list[Response], tokenizer, groups: int
                     ) -> list[dict[str, Any]]:
  """The step's first `groups` prompts' responses (config.train.log_rollouts), as
  rollouts.jsonl's records (`eval.response_record`: prompt, answer, response text, reward)."""
  return [response_record(res.request_id, prompts[res.request_id].row, res, tokenizer.decode(
      res.response_ids, skip_special_tokens=True), res.reward, res.reward_extra)
          for res in responses if res.request_id < groups]


def gather_responses(mine: list[Response]) -> list[Response]:
  """This process's scored responses -> every process's, sorted by (request_id,
  sample_index)."""
  every = [rec for part in distributed.all_gather_objects(mine) for rec in part]
  return sorted(every, key=lambda r: (r.request_id, r.sample_index))
