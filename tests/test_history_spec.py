"""Speculative decoding over external (history) drafts is lossless: greedy outputs identical
to plain decoding with a fake history index (good, misleading and empty drafts, stop tokens
inside drafts, ragged prompts, refill, compaction, preemption, history arms mixed with drafter
arms), sampled outputs distributed exactly as the target's with deliberately misleading
drafts (chi-square against the exact joint), and an acceptance rule without the p(c) test
failing the same test."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.drafter.model import drafter_cache
from tlt_jax.models import init_cache
from tlt_jax.rollout import drafts, spec_state, speculative
from tlt_jax.rollout.config import EngineConfig, SpecConfig
from tlt_jax.rollout.engine import Engine, chunk_reach
from tlt_jax.rollout.policies.cells import PolicyCells
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.policies.strategy import Strategy
from spec_helpers import (N, NEW, PEAKED, PROMPT, SAMPLING, SMALL, TINY, broken_p, chi_square_p,
                          exact_joint, make_peaked)

CFG = TINY


@dataclasses.dataclass
class Draft:
  tokens: np.ndarray  # [n] int32
  parents: np.ndarray  # [n] int32, -1 = child of the root
  scores: np.ndarray  # [n] float32


class FakeIndex:
  """The history index's interface over an oracle: each sequence's true continuation (plain
  greedy decoding), drafted correctly, corrupted, or not at all, by a fixed rule per call, so
  drafts are accepted in full, in part and not at it all. Trees put a misleading sibling before
  every true node. Also records what the engine told it (begin/extend/end)."""

  def __init__(self, oracle, vocab):
    self.oracle, self.vocab = oracle, vocab  # key -> prompt + full greedy response
    self.seqs, self.ended, self.calls = {}, {}, 0

  def begin(self, prompt_key, seq_key, prompt_ids):
    assert tuple(prompt_key) == tuple(int(t) for t in prompt_ids)
    self.seqs[seq_key] = [int(t) for t in prompt_ids]

  def extend(self, seq_key, tokens):
    self.seqs[seq_key].extend(int(t) for t in tokens)

  def end(self, seq_key, keep):
    self.ended.setdefault(seq_key, []).append((keep, self.seqs.pop(seq_key)))

  def stats(self):
    return {"calls": self.calls}

  def draft(self, seq_key, max_tokens, topk=1, max_nodes=None):
    self.calls += 1
    seq, true = self.seqs[seq_key], self.oracle[seq_key]
    cont = list(true[len(seq):len(seq) + max_tokens])
    cont += [(7 * len(seq) + i) % self.vocab for i in range(max_tokens - len(cont))]
    mode = (self.calls + seq_key[0]) % 4
    if mode == 0:  # no match
      return Draft(*(np.zeros((0,), t) for t in (np.int32, np.int32, np.float32)))
    if mode == 1:  # wrong from the second token on
      cont = cont[:1] + [(t + 1) % self.vocab for t in cont[1:]]
    if topk == 1:
      toks, pars = cont, list(range(-1, len(cont) - 1))
    else:  # a wrong sibling first at every depth, then the true node
      toks, pars, parent = [], [], -1
      for t in cont:
        toks += [(t + 3) % self.vocab, t]
        pars += [parent, parent]
        parent = len(toks) - 1
    n = len(toks) if max_nodes is None else min(len(toks), max_nodes)
    return Draft(np.asarray(toks[:n], np.int32), np.asarray(pars[:n], np.int32),
                 np.ones((n,), np.float32))


class CycleSelector:
  """Runs its arms in turn, whatever the rewards: history and drafter arms follow each other
  (the drafter's cache must stay coherent across history chunks)."""

  def __init__(self, arms):
    self.arms, self.i = [Strategy(a) for a in arms], 0  # a selector hands out strategies

  def select(self, batch_size, arms=None):
    self.i += 1
    return self.arms[self.i % len(self.arms)]

  def learns(self, arm, batch_size):
    return True

  def update(self, arm, batch_size, reward):
    pass

  def values(self, batch_size):  # (nothing measured: the compile plan keeps the listed order)
    return {}

  def choosable(self, lo, hi):
    return self.arms




def _requests(n, seed=0):
  rng = np.random.RandomState(seed)
  return [Request(list(rng.randint(1, CFG.vocab_size, rng.randint(2, 12))), i // 2, i % 2)
          for i in range(n)]


def _by_key(results):
  return {(r.request_id, r.sample_index): r for r in results}


@pytest.mark.parametrize("arms,pool", [
    (["hist_3"], {}), (["histtree_3_2_7"], {}),
    (["hist_2", "2_1_3", "histtree_2_2_5", "off"], {}),
    (["hyb_3", "hist_3", "2_1_3"], {}),
    (["hist_3"], dict(page_size=4, kv_pages=13))],  # a row reaches up to 10 pages
    ids=["chain", "tree", "mixed_with_drafter", "hybrid_mixed", "chain_preempting"])
def test_greedy_history_spec_equals_plain(tiny, plain_greedy, arms, pool):
  params, dparams = tiny
  reqs = _requests(9)
  sp = SamplingParams(temperature=0.0)
  # plain greedy decoding (conftest.py's plain_greedy: engines of SMALL, shared by the cases)
  oracle = {k: np.concatenate([r.prompt_ids, r.response_ids])
            for k, r in _by_key(plain_greedy(reqs)).items()}
  # A stop token that really fires inside some responses (and sits inside drafts).
  stop = int(np.bincount(np.concatenate([o[-20:] for o in oracle.values()])).argmax())
  plain = _by_key(plain_greedy(reqs, stop_tokens=(stop,)))
  assert any(r.finish_reason == "stop" for r in plain.values())
  index = FakeIndex(oracle, CFG.vocab_size)
  ecfg = EngineConfig(**SMALL, stop_tokens=(stop,), **pool,
                      spec=SpecConfig(strategy=arms[0], bs_threshold=4, patience=1,
                                      use_kernel=False))
  sel = CycleSelector(arms) if len(arms) > 1 else None
  w = Engine(params, CFG, ecfg, drafter_params=dparams, history=index, bandit=sel)
  spec = _by_key(w.generate(reqs, sp, policies=PolicyCells(sel)))
  hist = [m for m in w.chunk_log if m.mode != "off" and Strategy(m.mode).history]
  assert hist and sum(m.accepted for m in hist) > 0  # history drafts ran and were accepted
  assert {m.mode for m in w.chunk_log} >= set(arms)
  if pool:
    assert w.preemptions > 0
    assert any(not keep for ends in index.ended.values() for keep, _ in ends)
  for key, r in plain.items():
    np.testing.assert_array_equal(spec[key].response_ids, r.response_ids)
    assert spec[key].finish_reason == r.finish_reason
    # the index was told every row's text exactly once: its last end (kept) is the output
    keep, seq = index.ended[key][-1]
    assert keep and seq == list(r.prompt_ids) + list(r.response_ids)
  assert not index.seqs  # every row ended


class NotWantedGate:
  """A gate that allows speculation everywhere while saying speculation's data is not wanted
  (`drafter_wanted` False): the engine does not feed the history index until a history arm
  runs, then begins every live row with its text so far."""

  def closes(self, bucket):
    return True

  def probes(self, bucket):
    return False

  def defers(self, bucket, live):
    return False

  def begin_rollout(self, worker_id, choosable):
    pass

  def drafter_wanted(self):
    return False

  def may_speculate(self):
    return True

  def next_rollout(self):
    return self

  def allows(self, worker_id, bucket):
    return True

  def arms(self, worker_id, bucket):
    return []

  def holds(self, worker_id, bucket, ready=None):
    return False

  def probe_arm(self, bucket, default, among=None):
    return default

  def gives_way(self, bucket, arm):
    return False

  def leaves(self, bucket, to):
    return False

  def repays_window(self, bucket, arm, chunks_per_rollout, share):
    return True

  def runs_wide(self, bucket, arm, extra):
    return True

  def record(self, *args, **kw):
    pass

  def compiled(self, *args):
    pass


def test_history_fed_only_once_a_history_arm_runs(tiny, plain_greedy):
  params, dparams = tiny
  reqs = _requests(9)
  sp = SamplingParams(temperature=0.0)
  plain = _by_key(plain_greedy(reqs))
  oracle = {k: np.concatenate([r.prompt_ids, r.response_ids]) for k, r in plain.items()}
  index = FakeIndex(oracle, CFG.vocab_size)
  begun = {}  # key -> chunks the engine had run when the index first heard of the row
  begin = index.begin
  def recording_begin(prompt_key, seq_key, prompt_ids):
    begin(prompt_key, seq_key, prompt_ids)
    begun[seq_key] = len(w.chunk_log)
  index.begin = recording_begin
  ecfg = EngineConfig(**SMALL, spec=SpecConfig(strategy="2_1_3", bs_threshold=4, patience=1,
                                               use_kernel=False))
  # 2_1_3, 2_1_3, 2_1_3, hist_3, ...: the first chunks speculate with the drafter only
  selector = CycleSelector(["2_1_3", "2_1_3", "hist_3", "2_1_3"])
  w = Engine(params, CFG, ecfg, drafter_params=dparams, history=index, bandit=selector)
  spec = _by_key(w.generate(reqs, sp, policies=PolicyCells(selector, NotWantedGate())))
  modes = [m.mode for m in w.chunk_log]
  assert "hist_3" in modes and modes.index("hist_3") > 0
  for key, r in plain.items():
    np.testing.assert_array_equal(spec[key].response_ids, r.response_ids)
  # nothing was fed before the first history chunk; rows live then were begun with their
  # tokens so far: every row the index heard of ended with its whole text
  assert begun and min(begun.values()) == modes.index("hist_3")
  for key in begun:
    keep, seq = index.ended[key][-1]
    assert keep and seq == list(oracle[key])
  assert not index.seqs
  # without a history arm the index hears nothing
  quiet = FakeIndex(oracle, CFG.vocab_size)
  sel = CycleSelector(["2_1_3", "off"])
  Engine(params, CFG, ecfg, drafter_params=dparams, history=quiet, bandit=sel).generate(
      reqs, sp, policies=PolicyCells(sel, NotWantedGate()))
  assert not quiet.ended and not quiet.seqs


class ClosingGate(NotWantedGate):
  """Allows speculation everywhere until `after` speculative chunks ran at `bucket` (the
  engine's log), then closes that bucket (as a probe there that declines)."""

  def __init__(self, engine, bucket, after):
    self.engine, self.bucket, self.after = engine, bucket, after

  def drafter_wanted(self):
    return True

  def allows(self, worker_id, bucket):
    ran = sum(m.bucket == bucket and m.mode != "plain" for m in self.engine.chunk_log)
    return bucket != self.bucket or ran < self.after

  def arms(self, worker_id, bucket):
    return list(self.engine.arms) if self.allows(worker_id, bucket) else []


def _four_rows_2_1_3(tiny, plain_greedy, background):
  """An engine speculating with 2_1_3 from 4 live rows (compiling in the background or not)
  and 4 greedy requests with budgets of 24, 24, 10, 6 tokens (the batch compacts from 4 rows
  to 2 at some point), their plain decoding's results, the selector and a function listing
  the buckets switch-off was compiled at."""
  params, dparams = tiny
  reqs = [dataclasses.replace(r, max_new_tokens=n)
          for r, n in zip(_requests(4), (24, 24, 10, 6))]
  sp = SamplingParams(temperature=0.0)
  plain = _by_key(plain_greedy(reqs))
  ecfg = EngineConfig(**SMALL, spec=SpecConfig(strategy="2_1_3", bs_threshold=4, patience=1,
                                               use_kernel=False, background_compile=background))
  selector = CycleSelector(["2_1_3"])
  w = Engine(params, CFG, ecfg, drafter_params=dparams, bandit=selector)
  switch_offs = lambda: [r.batch for r in w.exes.records if r.name == "switch_off"]  # noqa: E731
  return w, reqs, sp, plain, selector, switch_offs


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_batch_whose_bucket_closes_stops_speculating_and_outputs_stay_plain(tiny, plain_greedy,
                                                                              background):
  """The gate closes the speculating batch's bucket mid-call: the batch switches off
  (spec_state.switch_off), decodes plainly there, compacts and switches on again where the
  gate allows it; greedy outputs are plain decoding's throughout. Compiling in the
  background, switch-off's executable was queued once the batch speculated."""
  w, reqs, sp, plain, selector, switch_offs = _four_rows_2_1_3(tiny, plain_greedy, background)
  # what the call runs compiled before it, as a run's earlier rollouts would: the first
  # rollouts decode plainly while the arms compile; once a batch speculated at 4 rows, the
  # compile thread compiled switch-off there, unused
  for _ in range(4 if background else 0):
    w.generate(reqs, sp, policies=PolicyCells(selector, ClosingGate(w, 4, 10**9)))
    w.compiles.wait()
    if 4 in switch_offs():
      break
  w.chunk_log.clear()
  assert (4 in switch_offs()) == background
  spec = _by_key(w.generate(reqs, sp, policies=PolicyCells(selector, ClosingGate(w, 4, 2))))
  for key, r in plain.items():
    np.testing.assert_array_equal(spec[key].response_ids, r.response_ids)
  log = [(m.bucket, m.mode) for m in w.chunk_log]
  off = log.index((4, "plain"))  # speculating from the first chunk until the bucket closed
  assert off >= 2 and log[:off] == [(4, "2_1_3")] * off, log
  assert (4, "2_1_3") not in log[off:], log  # plain decoding at the closed bucket...
  assert switch_offs().count(4) == 1  # (compiled ahead: none in the call's time)
  if not background:  # ...and on again below it (in the background, its arm at 2 rows
    # compiles meanwhile: the rest of the call decodes plainly)
    assert any(b < 4 and mode == "2_1_3" for b, mode in log[off:]), log


class GivingWayGate(NotWantedGate):
  """Allows speculation everywhere; once `after` speculative chunks ran at `bucket` (the
  engine's log), their arm gives way there (as a probed arm measured losing, the probe
  waiting on others: gate.gives_way)."""

  def __init__(self, engine, bucket, after):
    self.engine, self.bucket, self.after = engine, bucket, after

  def drafter_wanted(self):
    return True

  def arms(self, worker_id, bucket):
    return list(self.engine.arms)

  def gives_way(self, bucket, arm):
    ran = sum(m.bucket == bucket and m.mode == arm for m in self.engine.chunk_log)
    return arm is not None and bucket == self.bucket and ran >= self.after


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_an_arm_that_gives_way_leaves_its_bucket_to_plain_decoding(tiny, plain_greedy,
                                                                   background):
  """The only arm compiled at the batch's bucket gives way there mid-call: the batch
  switches off once (no switch-on and off again on each chunk), decodes plainly at that
  bucket and speculates again below it; greedy outputs are plain decoding's throughout."""
  w, reqs, sp, plain, selector, switch_offs = _four_rows_2_1_3(tiny, plain_greedy, background)
  for _ in range(4 if background else 0):  # (the arms and switch-off compiled: a warm worker)
    w.generate(reqs, sp, policies=PolicyCells(selector, GivingWayGate(w, 4, 10**9)))
    w.compiles.wait()
    if 4 in switch_offs() and all(w.compiles.compiled_arms(sp, b, ["2_1_3"]) for b in (2, 4)):
      break
  w.chunk_log.clear()
  spec = _by_key(w.generate(reqs, sp, policies=PolicyCells(selector, GivingWayGate(w, 4, 2))))
  for key, r in plain.items():
    np.testing.assert_array_equal(spec[key].response_ids, r.response_ids)
  log = [(m.bucket, m.mode) for m in w.chunk_log]
  off = log.index((4, "plain"))
  assert log[:off] == [(4, "2_1_3")] * 2, log  # the two chunks it took to give way
  assert (4, "2_1_3") not in log[off:], log
  assert switch_offs().count(4) == 1
  assert any(b < 4 and mode == "2_1_3" for b, mode in log[off:]), log


def test_history_arms_need_an_index(tiny):
  params, dparams = tiny
  with pytest.raises(ValueError, match="need a history index"):
    Engine(params, CFG, EngineConfig(**SMALL, spec=SpecConfig(strategy="hist_4")),
           drafter_params=dparams)


def test_history_strategy_grammar_and_reach():
  for arm in ["hist_1", "hist_4", "histtree_3_2_7", "histtree_2_4_21", "hyb_1", "hyb_4"]:
    assert Strategy(arm).name == arm and Strategy(arm).history
  assert [Strategy(a).kind for a in ["off", "4_1_5", "hist_4", "histtree_3_2_7", "hyb_4"]] \
      == ["off", "drafter", "history", "history", "hybrid"]
  assert Strategy("hist_4").verify_tokens == 5
  assert (Strategy("hyb_4").verify_tokens, Strategy("hyb_4").topk) == (9, 2)
  for bad in ["hist_0", "histtree_3_1_4", "histtree_2_2_8", "hist_", "hist_2_1_3", "hyb_0",
              "hyb_2_1_3"]:
    with pytest.raises(ValueError):
      Strategy(bad)
  # a chunk of 4 single steps: each commits <= steps + 1 and verifies verify_tokens slots
  assert chunk_reach(Strategy("hist_4"), 4) == 3 * 5 + 5
  assert chunk_reach(Strategy("histtree_2_4_6"), 4) == 3 * 3 + 6  # no drafter tree levels to reach
  # its drafter chain stays below the verified slots
  assert chunk_reach(Strategy("hyb_4"), 4) == 3 * 5 + 9


def test_external_tree_layout():
  """Padding, a parent that was dropped, a depth and a branching cap, a row not drafting."""
  tokens = jnp.asarray([[5, 6, 7, 8, 9, 4], [5, 6, 7, 0, 0, 0]], jnp.int32)
  parents = jnp.asarray([[-1, 0, -1, -1, 1, 4], [-1, 0, 1, -2, -2, -2]], jnp.int32)
  use = jnp.asarray([True, False])
  t = drafts.external_tree(jnp.asarray([3, 3]), tokens, parents, use, depth=2, topk=2)
  # row 0: node 1 (5, root), 2 (6, under 1), 3 (7, root), 4 (8: third root child, dropped),
  # 5 (9, under 2: depth 3, dropped), 6 (4, under a dropped node: dropped)
  np.testing.assert_array_equal(t.tokens[0], [3, 5, 6, 7, 0, 0, 0])
  np.testing.assert_array_equal(t.depth[0], [0, 1, 2, 1, 0, 0, 0])
  np.testing.assert_array_equal(t.children[0, :4], [[1, 3], [2, -1], [-1, -1], [-1, -1]])
  assert (np.asarray(t.children[0, 4:]) == -1).all()
  vis = np.asarray(t.visible[0])
  np.testing.assert_array_equal(vis[2], [1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(vis[5], [0, 0, 0, 0, 0, 1, 0])
  np.testing.assert_array_equal(t.tokens[1], [3, 0, 0, 0, 0, 0, 0])  # not drafting
  assert (np.asarray(t.children[1]) == -1).all()


def test_external_tree_drops_the_subtree_of_a_node_over_the_branching_cap():
  """Closed under ancestors: a node whose parent was dropped for the branching cap (the
  root's third child at topk 2) is dropped too, though its own depth (2) is within the cap."""
  tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
  parents = jnp.asarray([[-1, -1, -1, 2]], jnp.int32)
  t = drafts.external_tree(jnp.asarray([3]), tokens, parents, jnp.asarray([True]), depth=2,
                           topk=2)
  np.testing.assert_array_equal(t.tokens[0], [3, 5, 6, 0, 0])
  np.testing.assert_array_equal(t.depth[0], [0, 1, 1, 0, 0])
  np.testing.assert_array_equal(t.children[0, 0], [1, 2])
  assert (np.asarray(t.children[0, 1:]) == -1).all()
  np.testing.assert_array_equal(np.asarray(t.visible[0, 4]), [0, 0, 0, 0, 1])


def test_hybrid_draft_merges_the_two_chains():
  """Rows: the drafter departs from a full history chain at its second token; the history
  chain runs out after two tokens the drafter repeats; the history draft is not used."""
  hist = jnp.asarray([[5, 6, 7]] * 3, jnp.int32)
  hist_parents = jnp.asarray([[-1, 0, 1], [-1, 0, -2], [-1, 0, 1]], jnp.int32)
  chain = jnp.asarray([[5, 9, 7], [5, 6, 7], [8, 6, 7]], jnp.int32)  # the drafter's
  tokens, parents = drafts.hybrid_draft(hist, hist_parents, chain,
                                        jnp.asarray([True, True, False]))
  np.testing.assert_array_equal(tokens, [[5, 6, 7, 5, 9, 7], [5, 6, 7, 5, 6, 7],
                                         [5, 6, 7, 8, 6, 7]])
  np.testing.assert_array_equal(parents, [[-1, 0, 1, -2, 0, 4], [-1, 0, -2, -2, -2, 1],
                                          [-2, -2, -2, -1, 3, 4]])
  t = drafts.external_tree(jnp.asarray([3, 3, 3]), tokens, parents,
                           jnp.asarray([True] * 3), depth=3, topk=2)
  # row 0: root -> 5 -> {6 -> 7, 9 -> 7}: node 1 has the history child first
  np.testing.assert_array_equal(t.children[0, 1], [2, 5])
  np.testing.assert_array_equal(t.depth[0], [0, 1, 2, 3, 0, 2, 3])


# ------------------------------------------------------------------------ distribution tests
@pytest.fixture(scope="module")
def peaked():
  return make_peaked()


def _misleading(strategy, last, rows):
  """Deterministic drafts from a random table of (row class, last token): mostly wrong, right
  by chance; every fifth row drafts nothing. tokens, parents [B, verify_tokens - 1]."""
  n = strategy.verify_tokens - 1
  table = np.random.RandomState(7).randint(0, PEAKED.vocab_size, (11, PEAKED.vocab_size, n))
  tokens = table[rows % 11, last].astype(np.int32)
  if strategy.hybrid:  # the index's chain runs out after K - 1 tokens (columns K.. unused)
    parents = np.where(np.arange(n) < strategy.steps - 1, np.arange(n) - 1, -2)
  elif strategy.topk == 1:
    parents = np.arange(-1, n - 1)
  else:  # two root children, then each node's child under the previous ones
    parents = np.asarray([-1, -1] + list(range(n - 2)))[:n]
  parents = np.broadcast_to(parents.astype(np.int32), (len(rows), n)).copy()
  parents[rows % 5 == 0] = -2
  return tokens, parents


def _accept_first_child(target_logp, tree_tokens, children, uniforms, noise, *, greedy,
                        max_depth, use_kernel=True):
  """A broken rule: every draft accepted without the p(c) test (first child at every node),
  the next token from the target's distribution after the path."""
  b = tree_tokens.shape[0]
  rows = jnp.arange(b)
  node, path = jnp.zeros((b,), jnp.int32), [jnp.zeros((b,), jnp.int32)]
  for _ in range(max_depth):
    ch = children[rows, node, 0]
    path.append(jnp.where(ch >= 0, ch, -1))
    node = jnp.where(ch >= 0, ch, node)
  path = jnp.stack(path, axis=1)
  n = jnp.sum(path[:, 1:] >= 0, axis=1).astype(jnp.int32)
  nxt = jnp.argmax(target_logp[rows, node] + noise[rows, node], axis=-1).astype(jnp.int32)
  return path, n, nxt


def sample_history(params, dparams, sp, strategy, monkeypatch=None, verify=None):
  """N samples of the first NEW tokens of one batch of N rows (distinct keys), drafted step by
  step from the tokens emitted so far, as the engine's history loop does."""
  b = N
  toks = jnp.tile(jnp.asarray(PROMPT, jnp.int32), (b, 1))
  lens = jnp.full((b,), len(PROMPT), jnp.int32)
  keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(b))
  run = functools.partial(spec_state.prefill, cfg=PEAKED, max_steps=strategy.steps)
  state = jax.jit(run)(params, dparams, init_cache(PEAKED, b, 16, page_size=2),
                       drafter_cache(PEAKED, b, 16, page_size=2), toks, lens, keys,
                       jnp.full((b,), NEW, jnp.int32))
  if verify is not None:  # (name, a broken rule in its place)
    monkeypatch.setattr(speculative, *verify)
  step = jax.jit(functools.partial(speculative.history_step, cfg=PEAKED, sp=sp, stop_tokens=(),
                                   strategy=strategy, capture_hidden=False, use_kernel=False))
  rows = np.arange(b)
  last = np.full((b,), PROMPT[-1])
  seqs, acc = [[] for _ in range(b)], 0
  for _ in range(NEW):
    tokens, parents = _misleading(strategy, last, rows)
    state, out, a = step(params, dparams, state, jnp.asarray(tokens), jnp.asarray(parents))
    valid, emitted = np.asarray(out.valid), np.asarray(out.tokens)
    for i in range(b):
      seqs[i].extend(emitted[i][valid[i]])
    last = np.asarray([s[-1] for s in seqs])
    acc += int(a[0])
  assert all(len(s) == NEW for s in seqs)
  return np.asarray(seqs), acc


@pytest.mark.parametrize("arm,sp", [
    (arm, sp) for arm in ["hist_2", "histtree_2_2_5"] for sp in SAMPLING] + [
    ("hyb_3", SAMPLING[0])],  # the hybrid's tree goes through histtree's rule
    ids=["hist_2-t1", "hist_2-t0.8_topk4", "histtree-t1", "histtree-t0.8_topk4", "hyb_3-t1"])
def test_sampled_history_spec_matches_target_distribution(peaked, arm, sp):
  """hyb_3: misleading index chains of 2 tokens (none on every fifth row) and the drafter's
  argmax chain of 3, verified as one tree."""
  params, dparams = peaked
  seqs, acc = sample_history(params, dparams, sp, Strategy(arm))
  assert acc > 0.02 * N  # misleading drafts are accepted sometimes...
  assert acc < 0.9 * N * (NEW - 1)  # ...and rejected sometimes: both paths run
  assert chi_square_p(seqs, exact_joint(params, sp)) > 1e-3


@pytest.mark.parametrize("arm", ["hist_2", "histtree_2_2_5", "hyb_3"])
def test_broken_history_acceptance_is_detected(peaked, arm, monkeypatch):
  params, dparams = peaked
  sp = SAMPLING[0]
  strategy = Strategy(arm)
  seqs, _ = sample_history(params, dparams, sp, strategy, monkeypatch,
                           verify=("verify_tree", _accept_first_child))
  assert broken_p(seqs, exact_joint(params, sp)) < 1e-6


def test_background_compile_of_history_arms(tiny, plain_greedy):
  """History arms compile ahead like drafter arms (their step takes the draft arrays): a
  second generate call runs them with nothing compiled in the foreground, outputs unchanged."""
  params, dparams = tiny
  reqs, sp = _requests(6), SamplingParams(temperature=0.0)
  plain = _by_key(plain_greedy(reqs))
  oracle = {k: np.concatenate([r.prompt_ids, r.response_ids]) for k, r in plain.items()}
  arms = ["hist_2", "2_1_3", "histtree_2_2_5"]
  w = Engine(params, CFG, EngineConfig(
      **SMALL, spec=SpecConfig(strategy=arms[0], bs_threshold=4, patience=1, use_kernel=False,
                              background_compile=True)), drafter_params=dparams,
             history=FakeIndex(oracle, CFG.vocab_size), bandit=CycleSelector(arms))
  cells = PolicyCells(w.bandit)
  first = _by_key(w.generate(reqs, sp, policies=cells))
  w.compiles.wait(timeout=600)
  n = len(w.chunk_log)
  second = _by_key(w.generate(reqs, sp, policies=cells))
  chunks = w.chunk_log[n:]
  assert {c.mode for c in chunks} >= set(arms) and not any(c.compiled for c in chunks)
  for k in plain:
    np.testing.assert_array_equal(first[k].response_ids, plain[k].response_ids)
    np.testing.assert_array_equal(second[k].response_ids, plain[k].response_ids)


class LeavingGate(NotWantedGate):
  """Allows speculation at `bucket` alone, with every arm there; from `live_at` rows down,
  `leaves` says a batch speculating there decodes faster plainly at its rows' bucket (as the
  gate's measure would: its arm barely paying at `bucket`, a step there dearer)."""

  def __init__(self, engine, bucket, live_at):
    self.engine, self.bucket, self.live_at = engine, bucket, live_at
    self.asked = []

  def drafter_wanted(self):
    return True

  def allows(self, worker_id, bucket):
    return bucket == self.bucket

  def arms(self, worker_id, bucket):
    return list(self.engine.arms) if bucket == self.bucket else []

  def leaves(self, bucket, to):
    self.asked.append((bucket, to))
    return bucket == self.bucket and to <= self.live_at


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_speculating_batch_the_gate_says_to_leave_switches_off_and_compacts(tiny, plain_greedy,
                                                                              background):
  """A batch speculating at 4 rows, nothing of it compiled below (the gate allows only 4):
  once 2 rows are left and the gate says plain decoding at 2 beats speculating on at 4
  (`leaves`), it switches off once and compacts, decoding plainly below 4; told to stay
  (`live_at` 0), it speculates at 4 to the end. Greedy outputs are plain decoding's."""
  w, reqs, sp, plain, selector, switch_offs = _four_rows_2_1_3(tiny, plain_greedy, background)
  for _ in range(4 if background else 0):  # (the arm and switch-off compiled: a warm worker)
    w.generate(reqs, sp, policies=PolicyCells(selector, LeavingGate(w, 4, 0)))
    w.compiles.wait()
    if 4 in switch_offs() and w.compiles.compiled_arms(sp, 4, ["2_1_3"]):
      break
  for live_at in (0, 2):
    w.chunk_log.clear()
    gate = LeavingGate(w, 4, live_at)
    spec = _by_key(w.generate(reqs, sp, policies=PolicyCells(selector, gate)))
    for key, r in plain.items():
      np.testing.assert_array_equal(spec[key].response_ids, r.response_ids)
    log = [(m.bucket, m.mode, m.live) for m in w.chunk_log]
    assert (4, 2) in gate.asked, log  # (asked once 2 rows were left: nothing compiled at 2)
    if not live_at:
      assert all((b, mode) == (4, "2_1_3") for b, mode, _ in log), log
      continue
    off = next(i for i, (b, mode, _) in enumerate(log) if mode == "plain")
    assert all((b, mode) == (4, "2_1_3") for b, mode, _ in log[:off]), log
    assert all(b < 4 and mode == "plain" and n <= 2 for b, mode, n in log[off:]), log
  assert switch_offs().count(4) == 1
