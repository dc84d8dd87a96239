"""Rollout engine and sampler, checked against independent references.

* greedy decoding == transformers `generate(do_sample=False)` token for token (Qwen2, Llama,
  Qwen3; Qwen3 also speculatively, chain and tree), with ragged prompts, a stop token that
  fires, per-request caps, refill and compaction;
* batch-layout invariance: compaction on/off, chunk sizes, max_batch, multiple workers give
  identical greedy AND sampled outputs (per-row keys);
* the sampler's distribution == a float64 numpy re-implementation of HF's logits warpers
  (chi-square), both for `sample_tokens` directly and end to end through the engine;
* captured hidden states == the post-final-norm hidden state (the serving engines' drafter
  convention) of a full no-cache forward and of transformers (hook on `model.model.norm`'s
  output).

Models are tiny (vocab 96, 2 layers, width 32) with every tensor drawn from N(0, 0.3) so their
outputs are far from uniform/degenerate. Workers are module-scoped and shared between tests:
on CPU the cost is compiling one executable per (function, bucket).
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from scipy import stats
from transformers.generation import (TemperatureLogitsWarper, TopKLogitsWarper,
                                     TopPLogitsWarper)

from tlt_jax.models import compute_logits, forward
from tlt_jax.models.hf_io import load_hf_model
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.records import EngineHooks, Request
from tlt_jax.rollout.sampling import (SamplingParams, plain_variant, processed_logprobs,
                                      sample_tokens)

VOCAB = 96
MAX_NEW = 12
MAX_PROMPT = 16
PROMPT_LENS = (1, 3, 16, 7, 9, 11, 13, 2, 4, 6)  # ragged; one at exactly max_prompt_len
CAPS = (None, 5, None, 8, None)  # per-request max_new_tokens, cycled (None -> MAX_NEW)
GREEDY = SamplingParams(temperature=0.0)
T1 = SamplingParams(temperature=1.0)


# ------------------------------------------------------------------------------------ models
@dataclasses.dataclass
class TinyModel:
  arch: str
  path: str
  hf: torch.nn.Module
  cfg: object
  params: dict


def _build(arch: str, path: str, seed: int) -> TinyModel:
  common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-6)
  if arch == "qwen2":  # q/k/v biases, untied head
    hf_cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False,
                                      use_sliding_window=False)
    cls = transformers.Qwen2ForCausalLM
  elif arch == "qwen3":  # q/k norms, head_dim 16 != 32 / 4, tied head, Qwen3's rope theta
    hf_cfg = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True,
                                      rope_theta=1e6)
    cls = transformers.Qwen3ForCausalLM
  else:  # attention_bias (q/k/v/o biases), tied head, a different rope theta
    hf_cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True,
                                      rope_theta=500.0)
    cls = transformers.LlamaForCausalLM
  torch.manual_seed(seed)
  model = cls._from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
  with torch.no_grad():
    for p in model.parameters():  # every tensor, norms and biases included
      p.normal_(0.0, 0.3)
  model.eval()
  model.save_pretrained(path)
  cfg, params = load_hf_model(path, dtype="float32", param_dtype="float32")
  assert cfg.arch == arch and cfg.tie_word_embeddings == (arch != "qwen2")
  return TinyModel(arch, path, model, cfg, params)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  return {arch: _build(arch, str(tmp_path_factory.mktemp(arch)), seed)
          for arch, seed in (("qwen2", 0), ("llama", 1), ("qwen3", 2))}


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(123)
  return [rng.integers(0, VOCAB, size=n).tolist() for n in PROMPT_LENS]


def hf_greedy(model, prompt, max_new, eos=None) -> list[int]:
  ids = torch.tensor([prompt])
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new, min_new_tokens=0, eos_token_id=eos,
                         pad_token_id=eos if eos is not None else 0, num_beams=1)
  return out[0, len(prompt):].tolist()


def truncate(tokens: list[int], stop: int) -> list[int]:
  return tokens[:tokens.index(stop) + 1] if stop in tokens else tokens


def pick_stop(outputs: list[list[int]]) -> int:
  """A token in some greedy outputs (not as their first token) and absent from others, so
  both finish reasons occur."""
  n = len(outputs)
  best, best_score = None, -1
  for t in sorted({t for o in outputs for t in o[1:]}):
    hits = sum(t in o for o in outputs)
    score = min(hits, n - hits)
    if score > best_score:
      best, best_score = t, score
  assert best_score >= 2, f"degenerate greedy outputs: {outputs}"
  return best


def engine_cfg(**kw) -> EngineConfig:
  base = dict(max_batch=4, buckets=(1, 2, 4), chunk_size=4, compaction=True,
              max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW, prompt_bucket=MAX_PROMPT)
  base.update(kw)
  return EngineConfig(**base)


def greedy_requests(prompts):
  return [Request(p, request_id=i, max_new_tokens=CAPS[i % len(CAPS)])
          for i, p in enumerate(prompts)]


def sampled_requests(prompts):
  # 5 prompts x 2 samples: samples of one prompt must differ through their sample_index.
  return [Request(prompts[i], request_id=i, sample_index=s, max_new_tokens=CAPS[i % len(CAPS)])
          for i in range(5) for s in range(2)]


def by_id(results):
  return {(r.request_id, r.sample_index): r for r in results}


def run(worker, requests, sp, seed=0, hooks=None):
  """generate() plus the chunk_log entries of this call."""
  start = len(worker.chunk_log)
  res = worker.generate(requests, sp, seed=seed, hooks=hooks)
  return by_id(res), worker.chunk_log[start:]


@pytest.fixture(scope="module")
def greedy(models, prompts):
  """Per arch: HF reference outputs, the stop token, the worker and the engine results."""
  out = {}
  for arch, m in models.items():
    free = [hf_greedy(m.hf, p, MAX_NEW) for p in prompts]
    stop = pick_stop(free)
    caps = [c or MAX_NEW for c in (CAPS[i % len(CAPS)] for i in range(len(prompts)))]
    # HF with eos=stop and the cap: its eos-free output cut after the first stop / at the cap
    # (checked against generate(eos_token_id=stop) itself for a few prompts below).
    ref = [truncate(o[:c], stop) for o, c in zip(free, caps)]
    for i in range(3):
      assert hf_greedy(m.hf, prompts[i], caps[i], eos=stop) == ref[i]
    # Qwen's worker also captures hidden states (test_hidden_capture); Llama's does not.
    worker = Engine(m.params, m.cfg,
                    engine_cfg(stop_tokens=(stop,), capture_hidden=arch == "qwen2"))
    results, chunks = run(worker, greedy_requests(prompts), GREEDY)
    out[arch] = dict(ref=ref, stop=stop, caps=caps, worker=worker, results=results,
                     chunks=chunks)
  return out


# ------------------------------------------------------------------------- 1. greedy vs HF
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_greedy_matches_transformers(greedy, prompts, arch):
  g = greedy[arch]
  results = g["results"]
  assert sorted(results) == [(i, 0) for i in range(len(prompts))]
  reasons = []
  for i, (prompt, ref, cap) in enumerate(zip(prompts, g["ref"], g["caps"])):
    r = results[(i, 0)]
    assert r.response_ids.dtype == np.int32
    np.testing.assert_array_equal(r.prompt_ids, prompt)
    assert r.response_ids.tolist() == ref, f"{arch} request {i}"
    assert 1 <= r.num_tokens <= cap
    if r.response_ids[-1] == g["stop"]:
      assert r.finish_reason == "stop"
      assert g["stop"] not in r.response_ids[:-1].tolist()  # stopped at the first one
    else:
      assert r.finish_reason == "length" and r.num_tokens == cap
      assert g["stop"] not in r.response_ids.tolist()
    # greedy logprobs are the plain log-softmax of the chosen (max) token
    assert np.all(r.logprobs <= 0) and np.all(np.isfinite(r.logprobs))
    assert r.hidden is None or r.hidden.shape == (r.num_tokens, g["worker"].cfg.hidden_size)
    reasons.append(r.finish_reason)
  assert "stop" in reasons and "length" in reasons, reasons
  # more requests than max_batch: the worker refilled freed slots
  assert len(prompts) > g["worker"].ecfg.max_batch
  assert max(c.live for c in g["chunks"]) <= g["worker"].ecfg.max_batch
  assert sum(c.tokens for c in g["chunks"]) == sum(r.num_tokens for r in results.values())


@pytest.mark.parametrize("arm", ["3_1_4", "2_2_5"])  # a chain, a tree
def test_qwen3_speculative_greedy_matches_transformers(models, greedy, prompts, arm):
  """Qwen3 (q/k norms in the target AND in the drafter's layer) decoding speculatively: the
  same tokens as transformers' greedy generate. The drafter passes the target's hidden state
  through (fc picks it, the layer's weights are zero): it drafts the target's last prediction
  again, which this tiny model's repetitive greedy outputs often accept (25 drafts over 44
  verifications for the chain, 32 over 42 for the tree when written), so the accept and
  commit paths run, not only rejections."""
  from tlt_jax.drafter import init_drafter
  from tlt_jax.rollout.config import SpecConfig
  m, g = models["qwen3"], greedy["qwen3"]
  dparams = init_drafter(m.cfg, jax.random.key(0))
  d = m.cfg.hidden_size  # fc: [embedding, hidden] -> hidden (the target's own features)
  dparams["fc"] = jnp.concatenate([jnp.zeros((d, d)), jnp.eye(d)], 0)
  for k in ("q", "k", "v", "o", "gate", "up", "down"):  # a near-identity layer
    dparams["layers"][k] = dparams["layers"][k] * 0.0
  w = Engine(m.params, m.cfg, engine_cfg(
      stop_tokens=(g["stop"],),
      spec=SpecConfig(strategy=arm, bs_threshold=4, patience=1, use_kernel=False)),
      drafter_params=dparams)
  results, chunks = run(w, greedy_requests(prompts), GREEDY)
  spec = [c for c in chunks if c.mode == arm]
  assert spec and sum(c.accepted for c in spec) > 0, "no draft was ever accepted"
  for i, ref in enumerate(g["ref"]):
    assert results[(i, 0)].response_ids.tolist() == ref, f"request {i}"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v biases; q/k norms and a chain SD
def test_fused_replica_weights_match_transformers(models, greedy, prompts, arch):
  """The GPU's replica layout (one qkv and one gate/up matmul a layer, EngineConfig
  fused_projections) forced on here: plain and speculative greedy decoding give transformers'
  tokens, and new (learner-layout) weights are fused on their way in."""
  from tlt_jax.drafter import init_drafter
  from tlt_jax.rollout.config import SpecConfig
  m, g = models[arch], greedy[arch]
  spec = (SpecConfig(strategy="3_1_4", bs_threshold=4, patience=1, use_kernel=False)
          if arch == "qwen3" else None)
  w = Engine(m.params, m.cfg, engine_cfg(stop_tokens=(g["stop"],), fused_projections=True,
                                         spec=spec),
             drafter_params=init_drafter(m.cfg, jax.random.key(0)) if spec else None)
  assert w.fused and "qkv" in w.params["layers"][0] and "q" not in w.params["layers"][0]
  w.set_params(m.params)  # the learner's stacked layout again
  assert "gate_up" in w.params["layers"][1]
  results, chunks = run(w, greedy_requests(prompts), GREEDY)
  assert not spec or any(c.mode == "3_1_4" for c in chunks)
  for i, ref in enumerate(g["ref"]):
    assert results[(i, 0)].response_ids.tolist() == ref, f"request {i}"


@pytest.mark.parametrize("arch,arm,impl", [("qwen2", None, "pallas"), ("qwen2", None, "xla"),
                                           ("qwen3", "3_1_4", "xla"),
                                           ("qwen3", "2_2_5", "pallas")])
def test_paged_attention_engine_matches_transformers(models, greedy, prompts, arch, arm, impl,
                                                     monkeypatch):
  """The engine with paged attention (EngineConfig.paged_attention: the Pallas kernel,
  interpreted here, or its XLA form, the CPU's), pages of 4 slots (rows over several pages)
  and windows of 4 slots (where the windowed engine compiles 4, 8, 16, 28:
  test_attention_windows_do_not_change_outputs):
  plain, chain and tree speculative greedy decoding give transformers' tokens, and every
  executable has the one window, the whole cache."""
  from tlt_jax.drafter import init_drafter
  from tlt_jax.kernels import paged_attention as kernel
  from tlt_jax.rollout.config import SpecConfig
  monkeypatch.setattr(kernel, "default_impl", lambda: impl)
  m, g = models[arch], greedy[arch]
  spec = (SpecConfig(strategy=arm, bs_threshold=4, patience=1, use_kernel=False)
          if arm else None)
  ecfg = engine_cfg(stop_tokens=(g["stop"],), paged_attention=True, page_size=4,
                    prompt_bucket=4, spec=spec)
  w = Engine(m.params, m.cfg, ecfg,
             drafter_params=init_drafter(m.cfg, jax.random.key(0)) if spec else None)
  assert w.cfg.cache_attention == "paged"
  results, chunks = run(w, greedy_requests(prompts), GREEDY)
  assert not spec or any(c.mode == arm for c in chunks)
  windows = {r.key.variant[2] if r.name == "decode" else r.key.variant[3]
             for r in w.compile_log if r.name in ("decode", "spec")}
  assert windows == {ecfg.cache_len}, windows
  for i, ref in enumerate(g["ref"]):
    assert results[(i, 0)].response_ids.tolist() == ref, f"request {i}"


@pytest.mark.parametrize("impl,arm", [("xla", None), ("pallas", None), ("pallas", "2_2_5")])
def test_paged_attention_with_split_heads(models, greedy, prompts, monkeypatch, impl, arm):
  """A replica whose kv heads are split over two devices (tensor_parallel 2) with paged
  attention, its XLA form or the Pallas kernel (interpreted here), plain and tree-speculative:
  transformers' greedy tokens, and every call of the prefix's attention sees one device's kv
  heads (1 of 2): it runs per device, not over heads gathered onto each."""
  from tlt_jax.drafter import init_drafter
  from tlt_jax.kernels import paged_attention as kernel
  from tlt_jax.rollout.config import SpecConfig
  from tlt_jax.sharding import make_mesh
  m, g = models["qwen2"], greedy["qwen2"]
  monkeypatch.setattr(kernel, "default_impl", lambda: impl)
  seen = []
  name = {"xla": "prefix_attention_xla", "pallas": "prefix_attention"}[impl]
  real = getattr(kernel, name)
  monkeypatch.setattr(kernel, name, lambda q, *a, **k: seen.append(q.shape[1]) or real(q, *a, **k))
  spec = (SpecConfig(strategy=arm, bs_threshold=4, patience=1, use_kernel=False)
          if arm else None)
  ecfg = engine_cfg(stop_tokens=(g["stop"],), paged_attention=True, page_size=4, spec=spec)
  mesh = make_mesh((1, 1, 2), jax.devices()[:2])
  w = Engine(m.params, m.cfg, ecfg, mesh=mesh,
             drafter_params=init_drafter(m.cfg, jax.random.key(0)) if spec else None)
  results, chunks = run(w, greedy_requests(prompts), GREEDY)
  assert not spec or any(c.mode == arm for c in chunks)
  for i, ref in enumerate(g["ref"]):
    assert results[(i, 0)].response_ids.tolist() == ref, f"request {i}"
  assert seen and set(seen) == {m.cfg.num_kv_heads // 2}, seen


def test_greedy_logprobs_match_transformers(models, greedy, prompts):
  """The returned logprob of each greedy token is log_softmax of HF's logits at its step."""
  m, g = models["qwen2"], greedy["qwen2"]
  for i in (0, 2, 5):
    r = g["results"][(i, 0)]
    seq = torch.tensor([prompts[i] + r.response_ids.tolist()])
    with torch.no_grad():
      logits = m.hf(seq).logits[0].double()
    logp = torch.log_softmax(logits, -1).numpy()
    p = len(prompts[i])
    want = logp[np.arange(p - 1, p - 1 + r.num_tokens), r.response_ids]
    np.testing.assert_allclose(r.logprobs, want, atol=1e-4, rtol=0)


# ----------------------------------------------------- 2. batch-layout invariance, compaction
@pytest.fixture(scope="module")
def layouts(models, greedy, prompts):
  """The same requests through differently laid-out Qwen workers."""
  m, g = models["qwen2"], greedy["qwen2"]
  stop = (g["stop"],)
  main = g["worker"]
  no_compact = Engine(m.params, m.cfg, engine_cfg(stop_tokens=stop, compaction=False,
                                                         capture_hidden=True))
  # a different chunk size AND a max_batch that is not itself a bucket
  other_chunk = Engine(m.params, m.cfg, engine_cfg(stop_tokens=stop, chunk_size=3,
                                                          max_batch=3, capture_hidden=True))
  out = {"main": {}, "no_compact": {}, "other_chunk": {}}
  out["main"]["sampled"] = run(main, sampled_requests(prompts), T1, seed=0)
  out["no_compact"]["greedy"] = run(no_compact, greedy_requests(prompts), GREEDY)
  out["no_compact"]["sampled"] = run(no_compact, sampled_requests(prompts), T1, seed=0)
  out["other_chunk"]["sampled"] = run(other_chunk, sampled_requests(prompts), T1, seed=0)
  out["workers"] = {"main": main, "no_compact": no_compact, "other_chunk": other_chunk}
  return out


def assert_same_results(a, b, what):
  assert sorted(a) == sorted(b), what
  for k in a:
    ra, rb = a[k], b[k]
    assert ra.response_ids.tolist() == rb.response_ids.tolist(), (what, k)
    assert ra.finish_reason == rb.finish_reason, (what, k)
    np.testing.assert_allclose(ra.logprobs, rb.logprobs, atol=1e-5, rtol=0, err_msg=str(k))
    if ra.hidden is not None and rb.hidden is not None:
      np.testing.assert_allclose(ra.hidden, rb.hidden, atol=1e-5, rtol=1e-5, err_msg=str(k))


def test_compaction_does_not_change_outputs(greedy, layouts):
  g = greedy["qwen2"]
  assert_same_results(g["results"], layouts["no_compact"]["greedy"][0], "greedy, no compaction")
  assert_same_results(layouts["main"]["sampled"][0], layouts["no_compact"]["sampled"][0],
                      "sampled, no compaction")


def test_chunk_size_and_max_batch_do_not_change_outputs(layouts):
  res, chunks = layouts["other_chunk"]["sampled"]
  assert_same_results(layouts["main"]["sampled"][0], res, "sampled, chunk_size=3, max_batch=3")
  # max_batch=3 with buckets (1, 2, 4): never more than 3 live rows, even in the 4-bucket
  assert max(c.live for c in chunks) <= 3
  assert max(c.bucket for c in chunks) == 4
  assert all(c.steps <= 3 for c in chunks)


@pytest.mark.parametrize("variant", [dict(unroll=4), dict(early_exit=False, unroll=3, fused=True)],
                         ids=["unroll4", "fixed_unroll3_fused"])
@pytest.mark.parametrize("sp", [GREEDY, SamplingParams(temperature=1.0)], ids=["greedy", "t1"])
def test_decode_loop_variants_do_not_change_tokens(models, greedy, prompts, variant, sp):
  """The decode chunk's GPU variants (a loop of known trip count, several steps per
  iteration, fused qkv / gate-up projections) give the tokens, log-probs and validity of the
  engine's loop, with rows finishing on a stop token and on their budget inside the chunk."""
  import functools

  from tlt_jax.models import fuse_projections, init_cache, unstack_layers
  from tlt_jax.rollout import decode
  m = models["qwen2"]
  cfg, stop = m.cfg, greedy["qwen2"]["stop"]
  params = unstack_layers(m.params)
  b, p = 4, 16
  toks = np.zeros((b, p), np.int32)
  lens = np.array([len(q) for q in prompts[:b]], np.int32)
  for i, q in enumerate(prompts[:b]):
    toks[i, :len(q)] = q
  keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(b))
  max_new = jnp.asarray([12, 3, 12, 7], jnp.int32)
  state = jax.jit(functools.partial(decode.prefill, cfg=cfg))(
      params, init_cache(cfg, b, 48), jnp.asarray(toks), jnp.asarray(lens), keys, max_new)
  run_chunk = lambda prm, **kw: jax.jit(functools.partial(
      decode.decode_chunk, cfg=cfg, sp=sp, stop_tokens=(stop,), chunk=12,
      capture_hidden=True, **kw))(prm, state)
  _, want = run_chunk(params)
  kw = dict(variant)
  if kw.pop("fused", False):
    params = fuse_projections(params, cfg)
  _, got = run_chunk(params, **kw)
  valid = np.asarray(want.valid)
  assert valid.any() and not valid.all()  # rows finished inside the chunk
  np.testing.assert_array_equal(np.asarray(got.valid), valid)
  np.testing.assert_array_equal(np.where(valid, got.tokens, -1), np.where(valid, want.tokens, -1))
  np.testing.assert_allclose(np.where(valid, got.logprobs, 0), np.where(valid, want.logprobs, 0),
                             atol=1e-5)
  np.testing.assert_allclose(np.where(valid[..., None], got.hidden, 0),
                             np.where(valid[..., None], want.hidden, 0), atol=1e-5)


def test_compaction_shrinks_buckets(greedy, layouts):
  for chunks in (greedy["qwen2"]["chunks"], layouts["main"]["sampled"][1]):
    buckets = [c.bucket for c in chunks]
    assert buckets[0] == 4 and buckets[-1] < 4, buckets
    # every chunk runs at the smallest bucket holding its live rows once the queue is empty
    assert chunks[-1].bucket == min(b for b in (1, 2, 4) if b >= chunks[-1].live)
  no_compact = layouts["no_compact"]["greedy"][1]
  assert {c.bucket for c in no_compact} == {4}
  # compaction bought fewer row-steps for the same tokens
  def row_steps(chunks):
    return sum(c.bucket * c.steps for c in chunks)
  assert row_steps(greedy["qwen2"]["chunks"]) < row_steps(no_compact)
  for w in layouts["workers"].values():
    cs = w.compile_stats()
    assert cs["executables"] > 0 and cs["executables"] == len(w.compile_log)
    assert cs["compile_seconds"] > 0
  main = layouts["workers"]["main"]
  names = {r.name for r in main.compile_log}
  assert "take_rows" in names  # compaction really ran
  # one decode executable per (truncation, capture, attention window, bucket), recorded with
  # that bucket: the greedy and the sampled rollouts of this worker share them
  decode = [(r.batch, r.key.variant[2]) for r in main.compile_log
            if r.name == "decode" and r.key.variant[:2] == (plain_variant(GREEDY), True)]
  assert len(decode) == len(set(decode))
  ran = greedy["qwen2"]["chunks"] + layouts["main"]["sampled"][1]
  assert sorted({b for b, _ in decode}) == sorted({c.bucket for c in ran})


@pytest.mark.parametrize("ahead", [True, False])
def test_plain_executables_compiled_ahead(models, greedy, prompts, ahead):
  """compile_ahead (rollout/plain_ahead.py): the batch's first plain chunk queues the buckets
  below it on the compile thread, from its own state resized, and the tail runs them: each
  chunk below the first bucket finds its bucket's plain executable compiled before it runs
  (the compile thread drained after each chunk), one executable per bucket (the foreground
  looks up the very key compiled ahead), outputs as without. Without it, a bucket's
  executable appears only when a chunk there needs it."""
  m, g = models["qwen2"], greedy["qwen2"]
  # (chunk_size 5: executables no other engine of this file shares)
  w = Engine(m.params, m.cfg, engine_cfg(stop_tokens=(g["stop"],), capture_hidden=True,
                                         chunk_size=5, compile_ahead=ahead))
  decode = lambda: {r.batch for r in w.compile_log if r.name == "decode"}  # noqa: E731
  seen, found = [], []
  hooks = EngineHooks(before_chunk=lambda: seen.append(decode()),
                      on_chunk=lambda c: (found.append((c.bucket, c.bucket in seen[-1])),
                                          w.compiles.wait()))
  results, _ = run(w, greedy_requests(prompts), GREEDY, hooks=hooks)
  assert_same_results(g["results"], results, "greedy, plain executables compiled ahead")
  first = {}  # bucket -> whether its first chunk found its executable compiled
  for b, hit in found:
    first.setdefault(b, hit)
  assert first[4] is False and len(first) > 1, found
  assert all(hit == ahead for b, hit in first.items() if b < 4), found
  # ahead: every bucket below the first (2 too, which this batch skipped: 4 rows -> 1)
  decodes = [r.batch for r in w.compile_log if r.name == "decode"]
  assert sorted(decodes) == ([1, 2, 4] if ahead else sorted(first)), decodes


def test_attention_windows_do_not_change_outputs(models, greedy, prompts, monkeypatch):
  """Chunks attend over the window of the cache their rows reach (kv_len from the longest
  live row), not all of it: greedy outputs equal transformers' and sampled outputs (same
  keys) the whole-cache engine's, through ragged prompts, refills, compaction and rows
  that cross window boundaries mid-rollout (prompt_bucket 4: windows 4, 8, 16, 28; windows
  are the GPU's default, pinned here: this CPU's reads pages)."""
  m, g = models["qwen2"], greedy["qwen2"]
  cfg = engine_cfg(stop_tokens=(g["stop"],), prompt_bucket=4, capture_hidden=True,
                   paged_attention=False)
  windowed = Engine(m.params, m.cfg, cfg)
  res_g, _ = run(windowed, greedy_requests(prompts), GREEDY)
  for i, ref in enumerate(g["ref"]):
    assert res_g[(i, 0)].response_ids.tolist() == ref, i
  res_s, _ = run(windowed, sampled_requests(prompts), T1, seed=0)
  windows = {}
  for r in windowed.compile_log:
    if r.name == "decode":
      windows.setdefault(r.batch, set()).add(r.key.variant[2])
  assert len(windows[4]) >= 2 and min(windows[4]) < cfg.cache_len, windows  # crossed
  # the greedy and the sampled rollouts ran the same plain executables (the temperature is
  # an argument): no (bucket, window) compiled twice
  pairs = [(r.batch, r.key.variant[1:]) for r in windowed.compile_log if r.name == "decode"]
  assert len(pairs) == len(set(pairs)), pairs
  with monkeypatch.context() as mp:  # the reference: every chunk over the whole cache
    mp.setattr(EngineConfig, "window_for", lambda self, need: self.cache_len)
    whole = Engine(m.params, m.cfg, cfg)
    assert_same_results(res_g, run(whole, greedy_requests(prompts), GREEDY)[0], "greedy")
    assert_same_results(res_s, run(whole, sampled_requests(prompts), T1, seed=0)[0], "sampled")
    assert {r.key.variant[2] for r in whole.compile_log if r.name == "decode"} == {
        cfg.cache_len}


def test_kv_pages_admit_exhaust_and_preempt_without_changing_a_response(models, greedy,
                                                                         layouts, prompts):
  """A KV pool far smaller than max_batch rows of max length (9 pages of 4 slots; a row
  reaches up to 7): requests wait for pages to be admitted, live rows run out of pages
  mid-rollout and the youngest are preempted, then resumed (pages.py: their prompt
  prefilled, their tokens so far fed back). Every response is still transformers' greedy
  one, sampled responses equal those of an engine whose pool never runs out (per-row keys: a
  resumed row draws its next token with the key it would have), and no token is decoded
  twice: the chunks emit exactly the responses' tokens, though preempted rows had decoded
  some (the module's main Qwen worker: its default pool holds max_batch rows of max length,
  in pages of 16 slots; its sampled results are the `layouts` fixture's)."""
  m, g = models["qwen2"], greedy["qwen2"]
  roomy = engine_cfg(stop_tokens=(g["stop"],), page_size=4)
  tight = dataclasses.replace(roomy, kv_pages=9)
  w = Engine(m.params, m.cfg, tight)
  res_g, log_g = run(w, greedy_requests(prompts), GREEDY)
  for i, ref in enumerate(g["ref"]):
    assert res_g[(i, 0)].response_ids.tolist() == ref, i
  greedy_preempted = w.preemptions
  res_s, log_s = run(w, sampled_requests(prompts), T1, seed=0)
  assert greedy_preempted > 0 and w.preemptions > greedy_preempted  # pages ran out in both
  assert w.preempted_tokens > 0
  for res, log in ((res_g, log_g), (res_s, log_s)):
    assert sum(c.tokens for c in log) == sum(r.num_tokens for r in res.values())
  # admission by pages: never the 4 rows max_batch allows while requests waited
  assert max(c.live for c in log_g + log_s) < 4
  main = layouts["workers"]["main"]
  assert main.ecfg.pool_pages >= main.ecfg.max_batch * main.ecfg.row_pages  # never runs out
  assert main.preemptions == 0
  assert_same_results(res_s, layouts["main"]["sampled"][0], "sampled, tight pool vs roomy")
  with pytest.raises(Exception, match="kv_pages"):  # a pool must hold one longest row
    dataclasses.replace(roomy, kv_pages=6)


@pytest.mark.parametrize("arm,kv_pages", [(None, 14), ("3_1_4", 20)])  # (speculation's
def test_a_groups_rows_share_their_prompts_pages(models, greedy, prompts, monkeypatch, arm,
                                                 kv_pages):  # chunks reach further)
  """GRPO groups (3 samples of each of 4 prompts of 9-16 tokens) through a tight pool of
  4-slot pages: the rows of a shared prefill hold their prompt's whole pages once
  (pages.share_prompts), and a row admitted apart from its group holds a live sibling's
  (Replica._adopt: only the rest of its prompt fed), so the pool holds more live rows (the
  same responses in fewer chunks, no more preemptions) than when each row copies its
  prompt's pages, and nothing changes: greedy, every sample is transformers' response
  (plain, and speculative with a tracked drafter, whose cache shares the page ids); sampled,
  every response and log-prob equals the copying engine's (same keys)."""
  from tlt_jax.drafter import init_drafter
  from tlt_jax.rollout import call, replica
  from tlt_jax.rollout.config import SpecConfig
  m, g = models["qwen2"], greedy["qwen2"]
  spec = (SpecConfig(strategy=arm, bs_threshold=4, patience=1, use_kernel=False)
          if arm else None)
  ecfg = engine_cfg(stop_tokens=(g["stop"],), page_size=4, kv_pages=kv_pages,
                    spec=spec)
  ids = (2, 4, 5, 6)  # prompts of 16, 9, 11 and 13 tokens: 3, 2, 2 and 3 shareable pages
  group = lambda: [Request(prompts[i], request_id=i, sample_index=s,  # noqa: E731
                           max_new_tokens=CAPS[i % len(CAPS)]) for i in ids for s in range(3)]
  drafter = init_drafter(m.cfg, jax.random.key(0)) if spec else None
  shared = Engine(m.params, m.cfg, ecfg, drafter_params=drafter)
  res_g, log_g = run(shared, group(), GREEDY)
  for i in ids:
    for s in range(3):
      assert res_g[(i, s)].response_ids.tolist() == g["ref"][i], (i, s)
  res_s, log_s = run(shared, group(), T1, seed=3)
  # rows admitted apart from their group took a live sibling's pages (Replica._adopt)
  assert "adopt" in {r.name for r in shared.compile_log}
  with monkeypatch.context() as mp:  # the same engine, each row copying its prompt's pages
    mp.setattr(replica, "share_prompts", lambda pages, reqs: 0)
    mp.setattr(call.Call, "leader", lambda self, req: None)
    copying = Engine(m.params, m.cfg, ecfg, drafter_params=drafter)
    copy_g, clog_g = run(copying, group(), GREEDY)
    copy_s, clog_s = run(copying, group(), T1, seed=3)
  assert_same_results(res_g, copy_g, "greedy, shared vs copied prompt pages")
  assert_same_results(res_s, copy_s, "sampled, shared vs copied prompt pages")
  assert not spec or any(c.mode == arm for c in log_g + log_s)
  live = lambda log: sum(c.live for c in log) / len(log)  # noqa: E731
  assert shared.preemptions <= copying.preemptions
  # more rows decode together: the same responses in fewer chunks
  assert live(log_g + log_s) > live(clog_g + clog_s)
  assert len(log_g + log_s) < len(clog_g + clog_s)


@pytest.mark.parametrize("arm", [None, "3_1_4"])
def test_a_tensor_parallel_replica_resumes_and_adopts_through_a_tight_pool(models, greedy,
                                                                          prompts, arm):
  """The 32B/70B recipes' replicas split kv heads over devices (tensor_parallel 4 / 8): the
  rows' page tables, the extend that feeds a resumed row's text back and the adoption of a
  sibling's prompt pages run on a cache sharded by heads. GRPO groups through a replica of 2
  devices whose pool of 4-slot pages admits siblings apart (10 pages: and preempts rows): greedy,
  every sample is transformers' response (plain, and speculative with a tracked drafter);
  sampled, every response and log-prob equals a roomy single-device engine's (per-row keys)."""
  from tlt_jax.drafter import init_drafter
  from tlt_jax.rollout.config import SpecConfig
  from tlt_jax.sharding import make_mesh
  m, g = models["qwen2"], greedy["qwen2"]
  spec = (SpecConfig(strategy=arm, bs_threshold=4, patience=1, use_kernel=False)
          if arm else None)
  ids = (2, 4, 5, 6)
  group = lambda: [Request(prompts[i], request_id=i, sample_index=s,  # noqa: E731
                           max_new_tokens=CAPS[i % len(CAPS)]) for i in ids for s in range(3)]
  drafter = init_drafter(m.cfg, jax.random.key(0)) if spec else None
  roomy = engine_cfg(stop_tokens=(g["stop"],), page_size=4, paged_attention=True, spec=spec)
  tight = dataclasses.replace(roomy, kv_pages=20 if arm else 10)  # (speculation reaches further)
  w = Engine(m.params, m.cfg, tight, mesh=make_mesh((1, 1, 2), jax.devices()[:2]),
             drafter_params=drafter)
  res_g, log_g = run(w, group(), GREEDY)
  for i in ids:
    for s in range(3):
      assert res_g[(i, s)].response_ids.tolist() == g["ref"][i], (i, s)
  res_s, log_s = run(w, group(), T1, seed=3)
  names = {r.name for r in w.compile_log}
  assert {"extend", "adopt"} <= names, names  # siblings adopted (their prompts' tails fed)
  assert w.preemptions > 0 or arm  # (a speculating batch keeps its chunks' reach: none here)
  assert not spec or any(c.mode == arm for c in log_g + log_s)
  for res, log in ((res_g, log_g), (res_s, log_s)):  # no token decoded twice
    assert sum(c.tokens for c in log) == sum(r.num_tokens for r in res.values())
  one = Engine(m.params, m.cfg, roomy, drafter_params=drafter)
  assert_same_results(res_s, run(one, group(), T1, seed=3)[0], "sampled, tp 2 tight vs roomy")
  assert one.preemptions == 0


# ------------------------------------------------------------------------------- 3. seeds
def test_seed_determinism(greedy, layouts, prompts):
  worker = greedy["qwen2"]["worker"]
  first = layouts["main"]["sampled"][0]
  again, _ = run(worker, sampled_requests(prompts), T1, seed=0)
  other, _ = run(worker, sampled_requests(prompts), T1, seed=1)
  assert_same_results(first, again, "same seed")
  toks = lambda res: {k: r.response_ids.tolist() for k, r in res.items()}
  a, b = toks(first), toks(other)
  assert sum(a[k] != b[k] for k in a) >= 5, (a, b)
  # the two samples of a prompt differ (keys are folded with sample_index)
  assert sum(a[(i, 0)] != a[(i, 1)] for i in range(5)) >= 3, a
  # sampled outputs are not simply the greedy ones
  greedy_toks = {i: r.response_ids.tolist() for (i, _), r in greedy["qwen2"]["results"].items()}
  assert sum(a[(i, 0)] != greedy_toks[i] for i in range(5)) >= 3


def test_a_group_prefills_its_prompt_once_with_the_same_results(models, layouts, prompts):
  """The samples of a prompt side by side prefill it once (decode.prefill_shared) and decode
  exactly what a layout where no prefill holds a prompt twice decodes: same tokens, log-probs
  and hidden states per (prompt, sample)."""
  main = layouts["workers"]["main"]
  shared, _ = layouts["main"]["sampled"]  # (prompt, sample) pairs adjacent: shared prefills
  assert any(r.name == "prefill" and r.key.variant == "shared" for r in main.compile_log)
  interleaved = sorted(sampled_requests(prompts), key=lambda r: (r.sample_index, r.request_id))
  w = Engine(models["qwen2"].params, models["qwen2"].cfg, main.ecfg)
  alone, _ = run(w, interleaved, T1, seed=0)
  assert not any(r.name == "prefill" and r.key.variant == "shared"
                 for r in w.compile_log)  # no prefill shared
  assert_same_results(shared, alone, "sampled, shared prefill vs none")


# --------------------------------------------------------------- 4. sampler vs numpy reference
def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - np.max(x))
  return e / e.sum()


def ref_probs(logits, sp: SamplingParams) -> np.ndarray:
  """HF's temperature -> top-k -> top-p, in float64 numpy; ties at a threshold are kept."""
  x = np.asarray(logits, np.float64) / sp.temperature
  if sp.top_k and sp.top_k < x.size:
    kth = np.sort(x)[-sp.top_k]
    x = np.where(x < kth, -np.inf, x)
  if sp.top_p < 1.0:
    p = _softmax(x)
    order = np.argsort(p, kind="stable")  # ascending
    remove_sorted = np.cumsum(p[order]) <= 1.0 - sp.top_p
    remove_sorted[-1] = False  # keep at least one token
    keep = np.ones(x.size, bool)
    keep[order[remove_sorted]] = False
    keep |= p >= p[keep].min()  # a token tied with a kept one is kept
    x = np.where(keep, x, -np.inf)
  return _softmax(x)


def hf_probs(logits, sp: SamplingParams) -> np.ndarray:
  """The same processing through transformers' own logits warpers (float64)."""
  scores = torch.tensor(np.asarray(logits, np.float64))[None]
  if sp.temperature != 1.0:
    scores = TemperatureLogitsWarper(sp.temperature)(None, scores)
  if sp.top_k:
    scores = TopKLogitsWarper(sp.top_k)(None, scores)
  if sp.top_p < 1.0:
    scores = TopPLogitsWarper(sp.top_p)(None, scores)
  return torch.softmax(scores, -1)[0].numpy()


def assert_well_conditioned(logits, sp):
  """The top-p cut is not within float32 noise of a cumulative-mass boundary, so float32 vs
  float64 cannot disagree on the support (keeps the comparison deterministic)."""
  if sp.top_p >= 1.0:
    return
  x = np.asarray(logits, np.float64) / sp.temperature
  if sp.top_k:
    x = np.where(x < np.sort(x)[-sp.top_k], -np.inf, x)
  p = np.sort(_softmax(x))
  gaps = np.abs(np.cumsum(p) - (1.0 - sp.top_p))
  assert gaps.min() > 1e-4, gaps.min()


def chi_square(samples: np.ndarray, probs: np.ndarray) -> float:
  """p-value of the counts of `samples` under `probs`, pooling bins expected < 5 times."""
  n = samples.size
  counts = np.bincount(samples, minlength=probs.size).astype(np.float64)
  expected = n * probs
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  assert obs.size >= 2
  return float(stats.chisquare(obs, exp).pvalue)


SAMPLER_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.6, top_k=12, top_p=0.7),
]


@pytest.fixture(scope="module")
def fixed_logits():
  return np.random.default_rng(7).normal(0.0, 1.5, size=20).astype(np.float32)


def _draw(logits, sp, n, seed=0, traced=False):
  """n draws of `sample_tokens`; traced: as plain decoding runs it, the temperature an
  argument of the executable and only the truncation static (`plain_variant`)."""
  keys = jax.random.split(jax.random.key(seed), n)
  batch = jnp.broadcast_to(jnp.asarray(logits), (n, logits.size))
  if traced:
    fn = jax.jit(lambda k, b, t: sample_tokens(k, b, plain_variant(sp), t))
    toks, logp = fn(keys, batch, np.float32(sp.temperature))
  else:
    toks, logp = jax.jit(sample_tokens, static_argnums=2)(keys, batch, sp)
  return np.asarray(toks), np.asarray(logp)


def _processed(logits, sp, traced=False):
  if traced:
    fn = jax.jit(lambda x, t: processed_logprobs(x, plain_variant(sp), t))
    return np.asarray(fn(jnp.asarray(logits), np.float32(sp.temperature)))
  return np.asarray(processed_logprobs(jnp.asarray(logits), sp))


@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced_temperature"])
@pytest.mark.parametrize("sp", SAMPLER_CASES, ids=lambda sp: repr(sp))
def test_sampler_distribution(fixed_logits, sp, traced):
  assert_well_conditioned(fixed_logits, sp)
  ref = ref_probs(fixed_logits, sp)
  np.testing.assert_allclose(ref, hf_probs(fixed_logits, sp), atol=1e-12)  # reference == HF
  support = ref > 0
  if sp.top_k or sp.top_p < 1:
    assert 1 < support.sum() < fixed_logits.size  # the filters really cut something
    if sp.temperature != 1.0:  # ... and temperature-before-filtering matters for this case
      t1 = dataclasses.replace(sp, temperature=1.0)
      assert support.sum() != (ref_probs(fixed_logits, t1) > 0).sum()
  # processed log-probs
  lp = _processed(fixed_logits, sp, traced)
  assert np.array_equal(np.isfinite(lp), support)
  np.testing.assert_allclose(lp[support], np.log(ref[support]), atol=1e-5, rtol=0)
  # samples
  toks, logp = _draw(fixed_logits, sp, 20_000, traced=traced)
  assert toks.dtype == np.int32
  assert support[toks].all(), "sampled a token outside the processed support"
  np.testing.assert_allclose(logp, np.log(ref[toks]), atol=1e-5, rtol=0)
  p = chi_square(toks, ref)
  assert p > 1e-3, f"{sp}: chi-square p={p}"


def test_sampler_chi_square_has_power(fixed_logits):
  toks, _ = _draw(fixed_logits, SamplingParams(temperature=0.7), 20_000)
  wrong = ref_probs(fixed_logits, SamplingParams(temperature=1.0))
  assert chi_square(toks, wrong) < 1e-6
  # and a subtler mistake: top-p 0.8 sampled, checked against top-p 0.9
  toks, _ = _draw(fixed_logits, SamplingParams(top_p=0.8), 20_000)
  assert chi_square(toks, ref_probs(fixed_logits, SamplingParams(top_p=0.9))) < 1e-6


def test_sampler_keeps_ties_and_greedy(fixed_logits):
  logits = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
  for sp in (SamplingParams(top_k=2), SamplingParams(top_k=3, top_p=0.5)):
    ref = ref_probs(logits, sp)
    lp = np.asarray(processed_logprobs(jnp.asarray(logits), sp))
    np.testing.assert_array_equal(np.isfinite(lp), ref > 0)
    np.testing.assert_allclose(np.exp(lp), ref, atol=1e-6)
    assert (ref > 0).sum() == 4  # 3.0 and all three tied 2.0s
  # HF's top-k keeps ties too; its top-p cuts a tie wherever its sort puts it (top_k=3,
  # top_p=0.5 keeps 3.0 and ONE of the 2.0s), a documented deviation: ours keeps the tie.
  hf_k = hf_probs(logits, SamplingParams(top_k=2)) > 0
  np.testing.assert_array_equal(hf_k, ref_probs(logits, SamplingParams(top_k=2)) > 0)
  hf_p = hf_probs(logits, SamplingParams(top_k=3, top_p=0.5)) > 0
  assert hf_p.sum() == 2 and hf_p[0]
  # greedy: argmax token, plain log-softmax logprob, independent of the keys; the same from
  # plain decoding's executable, whose temperature 0 is an argument
  for traced in (False, True):
    toks, logp = _draw(fixed_logits, GREEDY, 64, traced=traced)
    assert (toks == np.argmax(fixed_logits)).all()
    np.testing.assert_allclose(logp, np.log(_softmax(fixed_logits)[np.argmax(fixed_logits)]),
                               atol=1e-6)


def test_sampling_params_validation():
  for kw in (dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
    with pytest.raises(ValueError):
      SamplingParams(**kw)


# --------------------------------------------------- 5. end-to-end engine sampling distribution
def test_engine_sampling_distribution(models, greedy, prompts):
  m = models["qwen2"]
  worker = greedy["qwen2"]["worker"]  # already compiled for this layout
  sp = SamplingParams(temperature=1.5, top_k=30, top_p=0.9)
  prompt = prompts[4]
  with torch.no_grad():
    logits = m.hf(torch.tensor([prompt])).logits[0, -1].double().numpy()
  assert_well_conditioned(logits, sp)
  ref = hf_probs(logits, sp)
  np.testing.assert_allclose(ref, ref_probs(logits, sp), atol=1e-12)
  support = ref > 0
  assert 5 <= support.sum() < VOCAB and ref.max() < 0.5, ref  # a non-trivial distribution
  n = 2000
  reqs = [Request(prompt, request_id=7, sample_index=s, max_new_tokens=1) for s in range(n)]
  results = worker.generate(reqs, sp, seed=3)
  assert len(results) == n and all(r.num_tokens == 1 for r in results)
  assert sorted(r.sample_index for r in results) == list(range(n))
  toks = np.array([r.response_ids[0] for r in results])
  logp = np.array([r.logprobs[0] for r in results])
  assert support[toks].all()
  np.testing.assert_allclose(logp, np.log(ref[toks]), atol=1e-4, rtol=0)
  p = chi_square(toks, ref)
  assert p > 1e-3, p
  # the same draws are NOT from the unprocessed softmax (the check can fail)
  assert chi_square(toks, _softmax(logits)) < 1e-6


# ----------------------------------------------------------------------- 6. hidden capture
def test_hidden_capture(models, greedy, layouts, prompts):
  m = models["qwen2"]
  cases = [(greedy["qwen2"]["results"][(i, 0)], prompts[i]) for i in (0, 2, 3, 6)]
  sampled = layouts["main"]["sampled"][0]
  cases += [(sampled[(i, 1)], prompts[i]) for i in (1, 4)]
  seqs = [prompt + r.response_ids.tolist() for r, prompt in cases]
  # One no-cache forward over all sequences, right-padded (causal: padding never leaks back).
  width = MAX_PROMPT + MAX_NEW
  toks = np.zeros((len(seqs), width), np.int32)
  for i, seq in enumerate(seqs):
    toks[i, :len(seq)] = seq
  pos = np.broadcast_to(np.arange(width, dtype=np.int32), toks.shape)
  full = np.asarray(jax.jit(lambda t, p: forward(m.params, t, p, cfg=m.cfg).hidden)(toks, pos))
  captured = []  # the output of HF's final norm: the post-norm state EAGLE drafters read
  handle = m.hf.model.norm.register_forward_hook(
      lambda mod, inp, out: captured.append(out.detach()))
  try:
    for i, ((r, prompt), seq) in enumerate(zip(cases, seqs)):
      assert r.hidden is not None and r.hidden.shape == (r.num_tokens, m.cfg.hidden_size)
      p = len(prompt)
      rows = np.arange(p - 1, p - 1 + r.num_tokens)
      np.testing.assert_allclose(r.hidden, full[i, rows], atol=1e-4, rtol=1e-4)
      captured.clear()
      with torch.no_grad():
        m.hf(torch.tensor([seq]))
      assert len(captured) == 1
      np.testing.assert_allclose(r.hidden, captured[0][0].numpy()[rows], atol=1e-4, rtol=1e-4)
  finally:
    handle.remove()
  # and the hidden really is what chose the token: greedy tokens are the argmax of its logits
  greedy_cases = cases[:4]
  hidden = np.concatenate([r.hidden for r, _ in greedy_cases])
  lg = np.asarray(compute_logits(m.params, jnp.asarray(hidden), m.cfg))
  np.testing.assert_array_equal(lg.argmax(-1),
                                np.concatenate([r.response_ids for r, _ in greedy_cases]))
  assert greedy["llama"]["results"][(0, 0)].hidden is None  # capture off -> None


def test_a_responses_output_keeps_its_last_hidden_states_and_first_speculative_token():
  """records.Output, by hand: 11 tokens in chunks of 4, 3 and 4 with hidden_keep 5. It never
  holds fewer than the last 5 hidden states (nor more chunks than those need: the last two,
  7 states), the result holds exactly the last 5 (hidden_offset 6), and spec_start is the
  response length at the FIRST speculating chunk (4), not a later one's."""
  from tlt_jax.rollout.records import Output
  hidden = np.random.default_rng(0).normal(size=(11, 3)).astype(np.float32)
  out = Output(keep=5)
  for lo, hi in ((0, 4), (4, 7), (7, 11)):
    if lo:
      out.speculating()
    out.append(np.arange(lo, hi, dtype=np.int32), np.full(hi - lo, -0.5, np.float32),
               hidden[lo:hi])
    assert out.kept >= min(hi, 5) and out.kept - len(out.hidden[0]) < 5
  r = out.result(Request([1, 2], 3, 1), stopped=True, worker_id=2, t=1.5)
  assert out.kept == 7
  np.testing.assert_array_equal(r.hidden, hidden[6:])
  np.testing.assert_array_equal(r.response_ids, np.arange(11))
  assert (r.hidden_offset, r.spec_start, r.num_tokens, r.finish_reason) == (6, 4, 11, "stop")
  assert (r.request_id, r.sample_index, r.worker_id) == (3, 1, 2)


def test_chunks_by_kind_by_hand():
  """records.by_kind: per kind of arm, tokens per verification, share of the step's tokens
  (here 200) and tokens/s while it ran; plain chunks are no kind."""
  from tlt_jax.rollout.policies.strategy import Strategy
  from tlt_jax.rollout.records import ChunkMetrics, by_kind
  chunks = [ChunkMetrics(0, 4, 4, 40, 4, 0.5, Strategy("4_1_5"), accepted=24, verifications=16),
            ChunkMetrics(0, 4, 4, 16, 4, 0.5, Strategy("hist_4"), accepted=0, verifications=16),
            ChunkMetrics(0, 4, 4, 64, 16, 1.0)]
  assert by_kind(chunks, 200) == {
      "drafter": {"tokens_per_verify": 2.5, "share_of_tokens": 0.2, "tokens_per_s": 80.0},
      "history": {"tokens_per_verify": 1.0, "share_of_tokens": 0.08, "tokens_per_s": 32.0}}


# ------------------------------------------------------------------- 7. workers on two devices
def test_two_workers_on_two_devices_under_the_coordinator(models, greedy, prompts):
  from tlt_jax.coordinator import Coordinator, ParamStore, Worker
  m, g = models["qwen2"], greedy["qwen2"]
  assert len(jax.devices()) >= 2
  main = g["worker"]
  assert main.mesh.devices.flat[0] == jax.devices()[0]
  second = Engine(m.params, m.cfg, main.ecfg, worker_id=1,
                  mesh=Mesh(np.array([jax.devices()[1]]).reshape(1, 1, 1),
                            ("data", "fsdp", "tensor")))
  assert {d for x in jax.tree.leaves(second.params) for d in x.devices()} == {jax.devices()[1]}
  lock = threading.Lock()
  seen = {"results": [], "chunks": []}

  def on_response(worker, res):
    with lock:
      seen["results"].append((worker.id, res))

  def on_chunk(c):
    with lock:
      seen["chunks"].append(c)

  coord = Coordinator([Worker(main), Worker(second)], ParamStore(m.params))
  reqs = greedy_requests(prompts)
  out = coord.rollout(reqs, GREEDY, seed=0, on_response=on_response, on_chunk=on_chunk)
  coord.close()
  res = out.results
  assert [(r.request_id, r.sample_index) for r in res] == [(i, 0) for i in range(len(reqs))]
  assert_same_results(g["results"], by_id(res), "two workers vs one")
  # whole prompt groups go to worker request_id % 2, and are reported on that worker
  assert all(r.worker_id == r.request_id % 2 for r in res)
  assert sorted((r.request_id, r.sample_index) for _, r in seen["results"]) == \
      [(i, 0) for i in range(len(reqs))]
  assert all(w == r.worker_id for w, r in seen["results"])
  assert sum(c.tokens for c in seen["chunks"]) == sum(r.num_tokens for r in res)
  assert {c.worker_id for c in seen["chunks"]} == {0, 1}
  for wid in (0, 1):
    mine = [r for r in res if r.worker_id == wid]
    assert sum(c.tokens for c in seen["chunks"] if c.worker_id == wid) == \
        sum(r.num_tokens for r in mine)
  summary = out.timeline.summary()
  assert summary["barrier_s"] == pytest.approx(out.wall)
  assert {p["worker"] for p in summary["per_worker"]} == {0, 1}


# ------------------------------------------------------------------------------- 8. errors
def test_validation_errors(greedy):
  worker = greedy["llama"]["worker"]
  cases = [
      (Request([], request_id=3), r"request 3: empty prompt"),
      (Request(list(range(MAX_PROMPT + 1)), request_id=4),
       rf"request 4: prompt has {MAX_PROMPT + 1} tokens, more than max_prompt_len={MAX_PROMPT}"),
      (Request([1, 2, VOCAB], request_id=5),
       rf"request 5: token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
      (Request([1, -1], request_id=6), r"request 6: token id -1 is outside the vocabulary"),
  ]
  n_exec = len(worker.compile_log)
  for req, msg in cases:
    # a bad request among good ones is rejected before any work is done
    with pytest.raises(ValueError, match=msg):
      worker.generate([Request([1, 2, 3], request_id=0), req], GREEDY)
  assert len(worker.compile_log) == n_exec
  assert worker.generate([], GREEDY) == []


def test_engine_config_errors():
  with pytest.raises(ValueError, match=r"largest bucket must be >= max_batch \(8\)"):
    EngineConfig(max_batch=8, buckets=(1, 2, 4))
  with pytest.raises(ValueError, match=r"strictly increasing"):
    EngineConfig(max_batch=4, buckets=(4, 2, 1))
  with pytest.raises(ValueError, match=r"strictly increasing"):
    EngineConfig(max_batch=4, buckets=())
  with pytest.raises(ValueError, match=r"^max_batch=0: must be >= 1"):
    EngineConfig(max_batch=0)
  for name in ("chunk_size", "max_prompt_len", "max_new_tokens", "prompt_bucket"):
    with pytest.raises(ValueError, match=rf"^{name}=0: must be > 0"):
      EngineConfig(**{name: 0})
  EngineConfig(max_batch=3, buckets=(1, 2, 4))  # buckets may overshoot max_batch


def test_drain_compilers_waits_for_queued_and_requeued_jobs():
  """`executables.drain_compilers` returns only once every compile thread has run what was
  queued on it and what those jobs queued (the tests' teardown clears JAX's caches after it:
  never beside a compile); a thread shut down is skipped."""
  import threading
  import time

  from tlt_jax.rollout import executables
  ex = executables.background_compiler("test-drain")
  done, gate = [], threading.Event()

  def slow(name, then=None):
    gate.wait(5)
    time.sleep(0.2)
    done.append(name)
    if then:
      ex.submit(then)

  ex.submit(slow, "first", lambda: slow("requeued"))
  ex.submit(slow, "second")
  gone = executables.background_compiler("test-drain-closed")
  gone.shutdown()
  gate.set()
  assert executables.drain_compilers() >= 1
  assert done == ["first", "second", "requeued"]
  ex.shutdown()


# ------------------------------------------------------- 8. executables shared in a process
def _double(x, *, k):
  return x * k


def test_unusable_donations_do_not_warn_from_compiling_threads():
  """The engine's executables donate states whose per-row leaves often cannot be reused; JAX's
  warning about them is dropped (rollout/executables.py), also when several threads compile
  at once (a per-compile warnings.catch_warnings lost its filter under background compiles).
  Measured against the same compile outside the engine, every warning shown."""
  import warnings
  from tlt_jax.rollout import executables

  def compile_one(n):
    return executables._compile(lambda x, y: x[:2] + n, (jnp.ones((4,)), jnp.ones((n,))),
                                (0, 1))

  with warnings.catch_warnings(record=True) as seen:
    threads = [threading.Thread(target=compile_one, args=(n,)) for n in range(3, 9)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    compile_one(9)
  assert not [w for w in seen if "donated buffers" in str(w.message)]
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    jax.jit(lambda x, y: x[:2] + 10, donate_argnums=(0, 1)).lower(
        jnp.ones((4,)), jnp.ones((10,))).compile()  # the same compile, not through the engine's
  assert [w for w in seen if "donated buffers" in str(w.message)]


def test_engines_of_one_process_share_their_executables(models, prompts, monkeypatch,
                                                        fresh_jax_cache):
  """A second engine with the same configuration on the same device takes every executable
  the first compiled (the same objects, its records priced at their compile's seconds) and
  returns the same results; one on another device (another rollout worker) compiles none of
  them: each is the first's loaded onto its device (port.py), and its results are the same;
  one with another chunk size shares only what does not depend on it (the prefill, the
  layout ops), not its decode chunks."""
  from tlt_jax.rollout import executables, sharing
  m = models["qwen2"]
  sharing.clear_shared()
  compiled, real = [], executables._compile
  monkeypatch.setattr(executables, "_compile",
                      lambda *a: compiled.append(a) or real(*a))
  cfg = engine_cfg()
  first, again = Engine(m.params, m.cfg, cfg), Engine(m.params, m.cfg, cfg)
  reqs = sampled_requests(prompts)
  ref = run(first, reqs, T1, seed=1)[0]
  assert_same_results(ref, run(again, reqs, T1, seed=1)[0], "sharing engine")
  own = {r.key: r for r in first.compile_log}
  assert {r.key for r in again.compile_log} == set(own)
  for r in again.compile_log:
    assert again.exes._compiled[r.key] is first.exes._compiled[r.key], r.key
    assert r.compile_s == own[r.key].compile_s > 0
  other = Engine(m.params, m.cfg, cfg, worker_id=1,
                 mesh=Mesh(np.array([jax.devices()[1]]).reshape(1, 1, 1),
                           ("data", "fsdp", "tensor")))
  wider = Engine(m.params, m.cfg, engine_cfg(chunk_size=2))
  before = len(compiled)
  got = run(other, reqs, T1, seed=1)[0]
  assert len(compiled) == before, "an engine on another device compiled its own"
  assert_same_results(ref, got, "engine on another device")
  assert {r.key for r in other.compile_log} == set(own)
  for r in other.compile_log:
    assert r.ported and r.compile_s == own[r.key].compile_s, r
    placed = jax.tree.leaves(other.exes._compiled[r.key].input_shardings)
    assert placed and {d for sh in placed for d in sh.device_set} == {jax.devices()[1]}, r.key
  assert_same_results(ref, run(wider, reqs, T1, seed=1)[0], "unshared engine")
  ids = lambda e: set(map(id, e.exes._compiled.values()))  # noqa: E731
  assert not ids(other) & ids(first)
  # the same cache key (a decode chunk's names no chunk size), another function: not shared
  common = set(wider.exes._compiled) & set(first.exes._compiled)
  assert {k.name for k in common} >= {"decode", "prefill"}, common
  for k in common:
    assert (wider.exes._compiled[k] is first.exes._compiled[k]) == (k.name != "decode"), k


@pytest.mark.parametrize("first_fails", [False, True])
def test_two_threads_asking_for_one_executable_compile_it_once(monkeypatch, first_fails):
  """A thread asking for an executable another thread is compiling (the engine's plain
  chunk needing the drafter's tracking the compile thread has started) waits for that
  compile: one compile, the same executable, for a shared function and for a closure (kept
  by its cache only). Where the first compile fails, the waiting thread compiles it itself."""
  from functools import partial
  from tlt_jax.rollout import executables, sharing
  real, started, release, calls = executables._compile, threading.Event(), threading.Event(), []

  def slow(fn, args, donate, *devices):
    calls.append(threading.get_ident())
    started.set()
    release.wait(30)
    if first_fails and len(calls) == 1:
      raise RuntimeError("RESOURCE_EXHAUSTED while compiling")
    return real(fn, args, donate, *devices)

  monkeypatch.setattr(executables, "_compile", slow)
  x = jnp.ones((4,), jnp.float32)
  for fn in (partial(_double, k=2.0), lambda v: v * 2.0):
    sharing.clear_shared()
    calls.clear(), started.clear(), release.clear()
    cache, out = executables.ExecutableCache(), {}

    def ask(who):
      try:
        out[who] = cache.get("f", None, fn, (x,))
      except RuntimeError as e:
        out[who] = e

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    second.join(0.5)  # (it asks while the first compiles)
    release.set()
    first.join(30), second.join(30)
    np.testing.assert_array_equal(out["second"](x), 2 * x)
    if first_fails:
      assert isinstance(out["first"], RuntimeError) and len(calls) == 2
    else:
      assert out["first"] is out["second"] and len(calls) == 1


def _placed(device_ids, shape=(4,)):
  """x's abstract shape on a one-axis mesh of these devices."""
  mesh = Mesh(np.array([jax.devices()[i] for i in device_ids]), ("t",))
  return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P()))


def test_a_program_another_worker_is_compiling_is_put_off_then_loaded_from_its_compile(
    monkeypatch, fresh_jax_cache):
  """Two workers' compile threads queue the same programs on their own devices: while the
  first compiles program a, the second (`compile_each`, deferring) compiles b first and takes
  a last, loaded from the first's compile (ported: one compile of a in the process); outside
  `deferring` it waits for that compile. Each executable computes on its own devices what
  numpy does. A port that fails compiles instead."""
  from functools import partial
  from tlt_jax.rollout import executables, port, sharing
  real, started, release, calls = executables._compile, threading.Event(), threading.Event(), []

  def slow(fn, args, donate, *devices):
    calls.append(fn.keywords["k"])
    if fn.keywords["k"] == 2.0 and len(calls) == 1:
      started.set()
      release.wait(30)
    return real(fn, args, donate, *devices)

  monkeypatch.setattr(executables, "_compile", slow)
  sharing.clear_shared()
  a, b = partial(_double, k=2.0), partial(_double, k=5.0)
  first, second, out = executables.ExecutableCache(), executables.ExecutableCache(), {}
  t = threading.Thread(target=lambda: out.setdefault("first", first.get("f", 2.0, a,
                                                                        (_placed([0]),))))
  t.start()
  assert started.wait(30)
  with pytest.raises(sharing.Elsewhere), sharing.deferring():
    second.get("f", 2.0, a, (_placed([1]),))
  order = []
  worker = threading.Thread(target=lambda: order.extend(sharing.compile_each(
      [a, b], lambda fn: second.get("f", fn.keywords["k"], fn, (_placed([1]),)), True)))
  worker.start()
  worker.join(0.5)
  assert order == [b] and calls == [2.0, 5.0], (order, calls)  # (b compiled while a is)
  release.set()
  t.join(30), worker.join(30)
  assert order == [b, a] and calls == [2.0, 5.0], (order, calls)
  x = np.arange(4, dtype=np.float32)
  for cache, dev in ((first, 0), (second, 1)):
    exe = cache.get("f", 2.0, a, (_placed([dev]),))
    y = exe(jax.device_put(x, _placed([dev]).sharding))
    np.testing.assert_array_equal(np.asarray(y), 2 * x)
    assert y.devices() == {jax.devices()[dev]}
    assert [r.ported for r in cache.records if r.key.variant == 2.0] == [dev == 1]
  monkeypatch.setattr(port, "port", lambda *a: (_ for _ in ()).throw(RuntimeError("no")))
  third = executables.ExecutableCache()
  np.testing.assert_array_equal(np.asarray(third.get("f", 2.0, a, (_placed([2]),))(
      jax.device_put(x, _placed([2]).sharding))), 2 * x)
  assert not third.records[0].ported and calls == [2.0, 5.0, 2.0]


def test_a_tensor_parallel_replicas_executable_is_loaded_onto_another_group_of_devices(
    fresh_jax_cache):
  """A program over a 2-device mesh (a tensor-parallel replica: a matmul split over its
  devices) compiled for devices 0-1 runs on 2-3 and 6-7 loaded from that compile, each
  group's result numpy's matmul, its output on its own devices; a 4-device mesh's program
  (other positions) is not taken from it."""
  from functools import partial
  from tlt_jax.rollout import executables, sharing
  sharing.clear_shared()
  rng = np.random.default_rng(0)
  w, x = rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=(3, 8)).astype(np.float32)

  def placed(ids):
    mesh = Mesh(np.array([jax.devices()[i] for i in ids]), ("t",))
    return (jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P(None, "t"))),
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())))

  fn = partial(_matmul, k=1.0)
  for ids, ported in (((0, 1), False), ((2, 3), True), ((7, 6), True), ((0, 1, 2, 3), False)):
    cache = executables.ExecutableCache()
    args = placed(ids)
    exe = cache.get("mm", None, fn, args)
    y = exe(jax.device_put(w, args[0].sharding), jax.device_put(x, args[1].sharding))
    np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-5, atol=1e-5)
    assert y.sharding.device_set == {jax.devices()[i] for i in ids}
    assert cache.records[0].ported == ported, ids


def test_an_executable_loaded_from_the_persistent_cache_is_not_loaded_onto_other_devices(
    fresh_jax_cache):
  """XLA:CPU's executables loaded from JAX's persistent cache, serialized again, lost kernels
  ("NOT_FOUND: Function ... not found" as they ran, jaxlib 0.12.0.1): a program the process
  took from the cache is no source for other devices. A second worker compiles (or, where the
  cache serves it, loads) its own, not ported, and computes what numpy does on its device; the
  program the process compiled itself is ported. The cache's executable handed back by JAX's
  in-memory cache to a later compile (no hit reported) is no source either."""
  from functools import partial
  from tlt_jax.rollout import executables, sharing
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # (every one written)
  try:
    fn, x = partial(_double, k=7.0), np.arange(4, dtype=np.float32)
    sharing.clear_shared()
    executables.ExecutableCache().get("f", 7.0, fn, (_placed([0]),))  # (written to the cache)
    sharing.clear_shared()
    jax.clear_caches()
    first = executables.ExecutableCache()
    first.get("f", 7.0, fn, (_placed([0]),))  # (a cache hit)
    second = executables.ExecutableCache()
    exe = second.get("f", 7.0, fn, (_placed([1]),))
    assert not second.records[0].ported
    y = exe(jax.device_put(x, _placed([1]).sharding))
    np.testing.assert_array_equal(np.asarray(y), 7 * x)
    assert y.devices() == {jax.devices()[1]}
    third = executables.ExecutableCache()  # (device 1's was compiled: a source)
    third.get("f", 7.0, fn, (_placed([2]),))
    assert third.records[0].ported
    # JAX's in-memory cache hands device 0's cache-loaded executable back to a new compile of
    # the same lowering, reporting no cache hit: still no source
    sharing.clear_shared()
    executables.ExecutableCache().get("f", 7.0, fn, (_placed([0]),))
    fifth = executables.ExecutableCache()
    exe = fifth.get("f", 7.0, fn, (_placed([3]),))
    assert not fifth.records[0].ported
    np.testing.assert_array_equal(np.asarray(exe(jax.device_put(x, _placed([3]).sharding))),
                                  7 * x)
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _matmul(w, x, *, k):
  return jnp.einsum("bi,io->bo", x, w) * k


def test_what_an_executable_depends_on_keeps_it_from_being_shared():
  """Shared: a module-level function, or a partial of one with equal arguments. Not shared: a
  closure (what it captured is not in the key), other keywords, another JAX precision."""
  from functools import partial
  from tlt_jax.rollout.executables import ExecutableCache
  from tlt_jax.rollout.sharing import clear_shared
  clear_shared()
  x = jnp.ones((4,), jnp.float32)
  a, b = ExecutableCache(), ExecutableCache()
  get = lambda cache, fn: cache.get("f", None, fn, (x,))  # noqa: E731
  assert get(a, partial(_double, k=2.0)) is get(b, partial(_double, k=2.0))
  assert get(ExecutableCache(), partial(_double, k=3.0)) is not get(a, partial(_double, k=2.0))
  three = 3.0
  closure = lambda v: v * three  # noqa: E731
  assert get(ExecutableCache(), closure) is not get(ExecutableCache(), closure)
  with jax.default_matmul_precision("bfloat16"):
    assert get(ExecutableCache(), partial(_double, k=2.0)) is not get(a, partial(_double, k=2.0))
  np.testing.assert_array_equal(get(ExecutableCache(), partial(_double, k=3.0))(x), 3 * x)
