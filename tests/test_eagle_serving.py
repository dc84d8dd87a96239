"""The shipped drafter's EAGLE export, run as vLLM / SGLang run it: a test that does not trust
the project.

`EagleDrafter` below is a small PyTorch EAGLE-1 forward written from the engines' code, not
from tlt_jax/drafter/model.py:
  - SGLang python/sglang/srt/models/qwen2_eagle.py (`Qwen2Model.forward`,
    `Qwen2DecoderLayerEagle`), python/sglang/srt/models/qwen3_eagle.py
    (`Qwen3ForCausalLMEagle`: a Qwen3ForCausalLM whose `model.eagle_fc` runs before its
    layers) and vLLM vllm/model_executor/models/llama_eagle.py (`LlamaModel.forward`):
    hidden = fc(cat(embed_tokens(ids), target_hidden)) with fc's bias (SGLang builds
    `nn.Linear(2D, D)` with one), layer 0 without its input norm (`input_layernorm` replaced
    by the identity), causal self-attention with RoPE (`rotate_half`, the target's
    rope_theta), GQA, Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm before RoPE
    (`Qwen3Attention`), the post-attention RMSNorm and the SiLU MLP, then
    `hidden_states + residual` with NO final norm;
  - the logits are the TARGET's LM head on that output (both engines share the target's
    `lm_head`; EAGLE's cnets1.py `topK_genrate` calls `head(last_hidden)`);
  - the target hidden state fed in is the one after the target's final norm: HF's last
    `hidden_states` entry (`last_hidden_state`, after `model.norm` for Qwen2, checked here
    against a forward pre-hook on the norm), which is what vLLM's `LlamaModel.forward`
    returns and SGLang's EAGLE worker captures.
It reads ONLY the export (model.safetensors + config.json via safetensors / json) and the
target through transformers' AutoModelForCausalLM.

Checks: (a) on a fixed context, its greedy chain of 4 drafts equals the project's drafter
(`drafter_forward` over the project's target forward) token for token, for the shipped Qwen2
drafter and for a Qwen3 target's export; (b) in a greedy chain-4
simulation (draft 4, verify with the torch target, accept the longest matching prefix + one
target token) on the first 12 default-task test prompts it reaches >= 95% of the tokens per
verification the project's own engine (`Engine`, arm 4_1_5, batch 1, greedy) reports, and
within 5% of it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

ASSETS = os.path.join(os.path.dirname(__file__), "..", "tlt_jax", "assets", "default")
MODEL = os.path.join(ASSETS, "model")
DRAFTER = os.path.join(ASSETS, "drafter")
EXPORT = os.path.join(DRAFTER, "eagle")
DEPTH, NUM_PROMPTS, MAX_NEW = 4, 12, 256


# ------------------------------------------------------------- the engines' EAGLE-1 forward
class EagleDrafter:
  """EAGLE-1 draft model from an export directory; embed / head are the target's."""

  def __init__(self, export_dir: str, target):
    with open(os.path.join(export_dir, "config.json")) as f:
      c = json.load(f)
    self.c = c
    w = {k: v.double() for k, v in load_file(os.path.join(export_dir,
                                                          "model.safetensors")).items()}
    assert c["num_hidden_layers"] == 1 and "layers.0.input_layernorm.weight" not in w
    self.w = w
    self.n, self.kv = c["num_attention_heads"], c["num_key_value_heads"]
    self.hd = c.get("head_dim") or c["hidden_size"] // self.n
    rp = c.get("rope_parameters") or {}
    assert (c.get("rope_scaling") or rp.get("rope_type", "default")) in (None, "default")
    self.theta = c.get("rope_theta", rp.get("rope_theta"))
    self.eps = c["rms_norm_eps"]
    self.fc = "eagle_fc" if "eagle_fc.weight" in w else "fc"  # Qwen3ForCausalLMEagle's name
    self.embed = target.get_input_embeddings().weight.detach().double()
    self.head = target.get_output_embeddings().weight.detach().double()  # [V, D]

  def _lin(self, x, name, bias=True):
    y = x @ self.w[name + ".weight"].T
    b = self.w.get(name + ".bias")
    return y + b if bias and b is not None else y

  def _rope(self, x, pos):  # x [T, heads, hd], HF rotate_half
    inv = 1.0 / self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
    f = pos.double()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x1, x2 = x[..., :self.hd // 2], x[..., self.hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin

  def _norm(self, x, name):  # RMSNorm over the last axis
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

  def forward(self, ids, hidden, pos):
    """ids [T], hidden [T, D] (target post-norm / own output), pos [T] -> (out, logits)."""
    x = self._lin(torch.cat([self.embed[ids], hidden.double()], -1), self.fc)
    t = x.shape[0]
    residual = x  # layer 0: no input_layernorm
    p = "layers.0.self_attn."
    q = self._lin(x, p + "q_proj").view(t, self.n, self.hd)
    k = self._lin(x, p + "k_proj").view(t, self.kv, self.hd)
    if p + "q_norm.weight" in self.w:  # Qwen3: each head normed over head_dim, before RoPE
      q, k = self._norm(q, p + "q_norm.weight"), self._norm(k, p + "k_norm.weight")
    q, k = self._rope(q, pos), self._rope(k, pos)
    v = self._lin(x, p + "v_proj").view(t, self.kv, self.hd)
    rep = self.n // self.kv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qnh,knh->nqk", q, k) / self.hd ** 0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.einsum("nqk,knh->qnh", s.softmax(-1), v).reshape(t, self.n * self.hd)
    x = residual + self._lin(a, p + "o_proj")
    residual = x
    h = self._norm(x, "layers.0.post_attention_layernorm.weight")
    m = "layers.0.mlp."
    x = residual + self._lin(torch.nn.functional.silu(self._lin(h, m + "gate_proj"))
                             * self._lin(h, m + "up_proj"), m + "down_proj")
    return x, x @ self.head.T  # hidden_states + residual, the target's head, no norm

  def chain(self, ids, hidden, pos, depth):
    """Greedy drafts from the pairs (ids[t], hidden[t]) at pos[t]: the engines' first draft
    step, then `depth - 1` steps feeding back (drafted token, own output) at pos + 1."""
    drafts, logits = [], []
    for _ in range(depth):
      out, lg = self.forward(ids, hidden, pos)
      d = int(lg[-1].argmax())
      drafts.append(d)
      logits.append(lg[-1])
      ids = torch.cat([ids, torch.tensor([d])])
      hidden = torch.cat([hidden.double(), out[-1:]])
      pos = torch.cat([pos, pos[-1:] + 1])
    return drafts, torch.stack(logits)


def target_hidden(target, ids):
  """[T, D] float64: the target's last hidden state after its final norm, per position."""
  with torch.no_grad():
    out = target(torch.tensor(ids)[None], output_hidden_states=True)
  return out.hidden_states[-1][0].double()


def simulate(drafter: EagleDrafter, target, prompts, eos: int, depth: int = DEPTH,
             max_new: int = MAX_NEW) -> float:
  """Greedy chain speculative decoding with the torch target verifying: returns tokens per
  verification ((accepted drafts + 1) averaged over verifications)."""
  head = target.get_output_embeddings().weight.detach().double()
  accepted = verifications = 0
  for prompt in prompts:
    seq = list(prompt)
    h = target_hidden(target, seq)
    pending = int((h[-1] @ head.T).argmax())  # the target's first token
    new = 1
    while pending != eos and new < max_new:
      n = len(seq)
      ids = torch.tensor(seq[1:] + [pending])
      with torch.no_grad():
        drafts, _ = drafter.chain(ids, h, torch.arange(n), min(depth, max_new - new))
      full = seq + [pending] + drafts
      hf = target_hidden(target, full)
      pred = (hf[n:] @ head.T).argmax(-1).tolist()  # the target's token after each
      a = 0
      while a < len(drafts) and drafts[a] == pred[a] and drafts[a] != eos:
        a += 1
      if a < len(drafts) and drafts[a] == pred[a]:  # an accepted eos ends the response
        a += 1
      verifications += 1
      accepted += a
      seq = full[:n + 1 + a]
      new += a + 1
      h = hf[:n + 1 + a]
      pending = eos if seq[-1] == eos else pred[a]
  return (accepted + verifications) / verifications


# ----------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def setup():
  from transformers import AutoModelForCausalLM, AutoTokenizer
  if not os.path.isfile(os.path.join(EXPORT, "model.safetensors")):
    pytest.skip("no shipped drafter export")
  target = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float64).eval()
  tok = AutoTokenizer.from_pretrained(MODEL)
  with open(os.path.join(ASSETS, "data", "test.jsonl")) as f:
    rows = [json.loads(line) for line, _ in zip(f, range(NUM_PROMPTS))]
  prompts = [tok.encode(r["prompt"]) for r in rows]
  eos = json.load(open(os.path.join(MODEL, "generation_config.json")))["eos_token_id"]
  # one thread: these are tiny matmuls, and torch's pool beside JAX's on 2 cores ran the
  # simulation ~100x slower
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield target, prompts, eos
  torch.set_num_threads(threads)


def test_hf_last_hidden_state_is_post_norm(setup):
  """The simulation's premise: HF's last hidden_states entry is after Qwen2's final norm."""
  target, prompts, _ = setup
  seen = {}
  hook = target.model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("post", o))
  try:
    h = target_hidden(target, prompts[0])
  finally:
    hook.remove()
  np.testing.assert_array_equal(h.numpy(), seen["post"][0].double().numpy())


def test_drafts_match_the_project_on_a_fixed_context(setup):
  from tlt_jax.drafter.model import load_drafter
  from tlt_jax.models.hf_io import load_hf_model
  target, prompts, _ = setup
  ctx = prompts[0] + [int(t) for t in prompts[1][:6]]  # a fixed context of real tokens
  h = target_hidden(target, ctx)
  pending = int((h[-1] @ target.get_output_embeddings().weight.double().T).argmax())
  drafter = EagleDrafter(EXPORT, target)
  with torch.no_grad():
    ours, lg = drafter.chain(torch.tensor(ctx[1:] + [pending]), h, torch.arange(len(ctx)), DEPTH)

  cfg, tp = load_hf_model(MODEL)
  theirs, their_lg = project_chain(cfg, tp, load_drafter(DRAFTER, cfg), ctx, pending)
  assert ours == theirs
  np.testing.assert_allclose(lg.numpy(), their_lg, rtol=1e-3, atol=1e-3)


def project_chain(cfg, tp, dp, ctx, pending, depth=DEPTH):
  """The project's greedy chain of `depth` drafts after `ctx` + `pending` (`drafter_forward`
  over the project's target forward) -> (drafts, their logits [depth, V])."""
  import jax.numpy as jnp

  from tlt_jax.drafter.model import drafter_forward
  from tlt_jax.models import forward
  ids = jnp.asarray([ctx], jnp.int32)
  fh = forward(tp, ids, jnp.arange(len(ctx))[None], cfg=cfg, return_logits=False).hidden
  tok = jnp.asarray([ctx[1:] + [pending]], jnp.int32)
  hid, pos = fh, jnp.arange(len(ctx))[None]
  drafts, lgs = [], []
  for _ in range(depth):
    g, logits, _ = drafter_forward(dp, tp, tok, hid, pos, cfg=cfg)
    d = int(jnp.argmax(logits[0, -1]))
    drafts.append(d)
    lgs.append(np.asarray(logits[0, -1]))
    tok = jnp.concatenate([tok, jnp.asarray([[d]], jnp.int32)], 1)
    hid = jnp.concatenate([hid, g[:, -1:]], 1)
    pos = jnp.concatenate([pos, pos[:, -1:] + 1], 1)
  return drafts, np.stack(lgs)


def test_qwen3_export_drafts_as_sglang_would(tmp_path):
  """A drafter for a Qwen3 target (its layer has q/k norms), exported for SGLang's
  Qwen3ForCausalLMEagle: the torch forward above, reading only the export and a transformers
  Qwen3 target, drafts the project's tokens with its logits."""
  import jax

  from tlt_jax.drafter import init_drafter
  from tlt_jax.drafter.model import export_eagle
  from tlt_jax.models.hf_io import load_hf_model, read_hf_config
  config = transformers.Qwen3Config(
      vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
      tie_word_embeddings=True)
  torch.manual_seed(0)
  target = transformers.AutoModelForCausalLM.from_config(config)
  with torch.no_grad():
    for name, p in target.named_parameters():
      p.normal_(1.0, 0.3) if name.endswith("norm.weight") else p.normal_(0.0, 0.3)
  target = target.double().eval()
  target.save_pretrained(tmp_path / "target")
  cfg, tp = load_hf_model(str(tmp_path / "target"))
  dp = init_drafter(cfg, jax.random.key(1), std=0.3)
  keys = jax.random.split(jax.random.key(2), 2)  # norms away from 1, so a dropped one shows
  for k, name in zip(keys, ("q_norm", "k_norm")):
    dp["layers"][name] = 1.0 + 0.3 * jax.random.normal(k, dp["layers"][name].shape)
  written = export_eagle(str(tmp_path / "eagle"), dp, cfg, engine="sglang",
                         target_hf_config=read_hf_config(str(tmp_path / "target")))
  assert written["architectures"] == ["Qwen3ForCausalLMEagle"]
  drafter = EagleDrafter(str(tmp_path / "eagle"), target)
  assert {"eagle_fc.weight", "eagle_fc.bias", "layers.0.self_attn.q_norm.weight",
          "layers.0.self_attn.k_norm.weight"} <= set(drafter.w)
  ctx = np.random.default_rng(0).integers(0, 96, 20).tolist()
  h = target_hidden(target, ctx)
  pending = int((h[-1] @ target.get_output_embeddings().weight.double().T).argmax())
  with torch.no_grad():
    ours, lg = drafter.chain(torch.tensor(ctx[1:] + [pending]), h, torch.arange(len(ctx)),
                             DEPTH)
  theirs, their_lg = project_chain(cfg, tp, dp, ctx, pending)
  assert ours == theirs
  np.testing.assert_allclose(lg.numpy(), their_lg, rtol=1e-3, atol=1e-3)


def project_tokens_per_verification(prompts, eos) -> float:
  """The project's engine: arm 4_1_5 at batch 1, greedy (what `python -m tlt_jax.generate
  --spec 4_1_5 --temperature 0 --batch_size 1` reports)."""
  from tlt_jax.drafter.model import load_drafter
  from tlt_jax.models.hf_io import load_hf_model
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request, tokens_per_verification
  from tlt_jax.rollout.sampling import SamplingParams
  cfg, params = load_hf_model(MODEL)
  spec = SpecConfig(strategy="4_1_5", bs_threshold=1, patience=1, use_kernel=False)
  ecfg = EngineConfig(max_batch=1, buckets=(1,), chunk_size=16, max_prompt_len=16 * -(
      -max(map(len, prompts)) // 16), max_new_tokens=MAX_NEW, stop_tokens=(eos,), spec=spec)
  engine = Engine(params, cfg, ecfg, drafter_params=load_drafter(DRAFTER, cfg))
  engine.generate([Request(p, request_id=i) for i, p in enumerate(prompts)],
                  SamplingParams(temperature=0.0))
  return tokens_per_verification([c for c in engine.chunk_log if c.mode != "plain"])


def test_serving_forward_accepts_as_the_project_does(setup):
  target, prompts, eos = setup
  served = simulate(EagleDrafter(EXPORT, target), target, prompts, eos)
  ours = project_tokens_per_verification(prompts, eos)
  print(f"tokens per verification, greedy chain-{DEPTH}, {len(prompts)} prompts: "
        f"served (engines' EAGLE-1 forward on the export) {served:.2f}, project {ours:.2f}")
  assert served >= 0.95 * ours and abs(served - ours) <= 0.05 * ours, (served, ours)
