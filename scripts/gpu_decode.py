#!/usr/bin/env python
"""How close decoding runs to the bandwidth limit, and which engine settings get it there:
every variant in ONE stage, so a single short GPU run decides (issue #47, ../shared/GPU.md 2).

    python scripts/gpu_decode.py [--dtype bfloat16] [--iters 64] [--flag_sets default,cmdbuf]
                                 [--shape 4096,128,64,11008,6,32] [--out DIR] [--quick]

The target is the bench target's shape (scripts/make_bench_model.py as gpu_check.sh makes it:
hidden 4096, 128 heads of 32, 64 kv heads, MLP 11008, 6 layers, the shipped 32-token
vocabulary: 1.11B parameters) with random weights made on the device: a step's bytes and time
do not depend on what the weights say. (Until 2026-12-04 it was a narrow 24-layer 1.13B shape,
hidden 2048 and MLP 5632, whose small matrices decoded at 46-59% of the copy bandwidth where the
wide target's plain step, in the cost model stage, moved its weights at 83%.)

Each XLA flag set runs in a subprocess of its own (XLA reads XLA_FLAGS once per process):
  default        XLA's defaults
  cmdbuf         command buffers (CUDA graphs) around the decode loop's WHILE and CONDITIONAL
                 too, from one kernel up: the loop's condition never syncs the host
  autotune 0     no autotuning of the matmuls, the whole process (the `noautotune` cells below
                 measure the same per executable)
and in each, code variants of the decode chunk (tlt_jax/rollout/decode.py, models.transformer):
  engine         decode_chunk as the engine runs it on a GPU: one qkv and one gate/up matmul a
                 layer (models.fuse_projections), paged attention (kernels/paged_attention.py:
                 each row's live pages read in place, one executable for every window; the
                 cell also reports the kernel's largest difference from XLA's attention over
                 the same cache, bf16 inputs, float32 reference), a while loop that exits once
                 every row is done (the device sends its condition to the host every step)
  windows        attention windows instead (the window's pages gathered: an executable each)
  cublas         the chunk's executable compiled with Triton's GEMM fusions off (narrow dots on
                 cuBLAS), per executable (jit's compiler_options, as the engine would set it
                 for its own executables only): on 2026-12-04 the batch-1 step's Triton GEMM
                 fusions read their weights at ~48% of the copy bandwidth where the dot XLA
                 turned into a reduction read its at ~79%
  noautotune     the chunk's executable compiled without autotuning its matmuls (jit's
                 compiler_options, xla_gpu_autotune_level 0): what it costs a step, what it saves
                 a compile (an arm's executable compiled in 15.3 s on 2026-12-04, the main job's
                 gate keeping speculation off for it; the process's autotuning cache holds the
                 shapes earlier cells tuned, so the cells with autotuning to compare against are
                 the first of their shapes: the engine at batch 8, the first spec cell)
  unfused        separate q, k, v and gate, up matmuls
  fixed          a known trip count (finished rows masked), no per-step condition
  u4             4 decode steps per loop iteration
  spec A         one speculative step of arm A (verification forward + drafter steps)
  profile        also a profiler trace of the loop (tlt_jax/profiling.py): kernels
                 a step, the device's busy time against the wall, the top kernels by time
Every cell: the step's time inside one compiled loop (best of 5 calls, divided by the steps;
random weights and KV, rows at 64 tokens), the bytes it must move (weights read once + the KV
window it reads, or with paged attention the rows' live slots, mean over the loop; a
speculative step: the target once, the drafter and its LM head once per draft step, both
KV windows), and those bytes over the time as a share of the copy bandwidth measured in the
same process (roofline.copy_bandwidth). Also each executable's compiled memory against the
weights + KV cache from shapes, and the device's peak bytes in use.

Prints markdown as it goes and writes OUT/gpu_decode.json after every cell (a time-boxed run
keeps the rows it finished, and the headline its figures); a cell that would end past
--budget_s by the slowest cell so far is not started. The last section names the fastest
variant per batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CMDBUF = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,"
          "CONDITIONAL --xla_gpu_graph_min_graph_size=1")
CUBLAS = {"xla_gpu_enable_triton_gemm": False}  # the "cublas" cells' compiler options
NOAUTOTUNE = {"xla_gpu_autotune_level": 0}  # the "noautotune" cells'
FLAG_SETS = {  # (the processes run in this order)
    "default": "",
    "cmdbuf": CMDBUF,
    "autotune 0": "--xla_gpu_autotune_level=0",
}
# (flag set, code variant, batches): the most informative cells first in each process. The
# 2026-12-04 H200 run measured what is not here (on the narrow shape): fused projections 1.03x
# at batch 1 and equal
# at 8, 4 steps an iteration and a fixed trip count nothing, paged attention 0.97x / 0.98x /
# 1.08x of the windows at batch 1 / 8 / 64 (docs/gpu.md)
PLAN = (
    ("default", "engine profile", (1, 8)),
    ("default", "engine spec 4_1_5", (1,)),
    ("default", "engine noautotune", (1,)),
    ("default", "engine noautotune spec 4_1_5", (1,)),
    ("default", "engine cublas profile", (1,)),
    ("default", "engine cublas", (8,)),
    ("default", "engine cublas spec 4_1_5", (1,)),
    ("default", "engine", (64,)),
    ("default", "windows", (64,)),
    ("cmdbuf", "engine", (1,)),
)
QUICK_PLAN = (  # --quick (the CPU smoke): every kind of cell once
    ("default", "engine profile", (1, 2)),
    ("default", "engine fixed u4", (1,)),
    ("default", "engine spec 3_1_4", (1,)),
    ("default", "windows", (1,)),
    ("cmdbuf", "engine unfused cublas noautotune", (1,)),
)


def parse_code(code: str) -> dict:
  """A cell's code (module docstring) -> its settings: the engine's GPU default unless a word
  turns one off."""
  words = code.split()
  arm = words[words.index("spec") + 1] if "spec" in words else None
  return {"fused": "unfused" not in words, "early_exit": "fixed" not in words,
          "unroll": 4 if "u4" in words else 1, "arm": arm, "profile": "profile" in words,
          "paged": "windows" not in words, "cublas": "cublas" in words,
          "noautotune": "noautotune" in words}


def compiler_options(c: dict) -> dict | None:
  """A parsed cell's per-executable XLA options (None: XLA's defaults)."""
  opts = {**(CUBLAS if c["cublas"] else {}), **(NOAUTOTUNE if c["noautotune"] else {})}
  return opts or None


def paged_parity(cfg, cache, rows: int, t: int) -> float:
  """The paged kernel against XLA's attention (float32, `models.attention.attend` over the
  committed slots gathered and the chunk's causal tokens) on layer 0 of `cache`: the largest
  absolute difference of their outputs, random queries and chunk keys of the cache's dtype."""
  import jax
  import jax.numpy as jnp

  from tlt_jax.kernels.paged_attention import paged_attention
  from tlt_jax.models.attention import attend
  from tlt_jax.models.kv_cache import gather_window

  h, kh, dt = cfg.head_dim_, cfg.num_kv_heads, cfg.compute_dtype
  key = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(key[0], (rows, t, cfg.num_heads, h), dt)
  k_new, v_new = (jax.random.normal(k, (rows, t, kh, h), dt) for k in key[1:])
  c = cache.replace(table=cache.table[:rows], lengths=cache.lengths[:rows])
  got = jax.jit(paged_attention)(q, c.k[0], c.v[0], c.table, c.lengths, k_new, v_new)
  f32 = lambda x: x.astype(jnp.float32)
  keys = jnp.concatenate([f32(gather_window(c.k[0], c.table, c.max_len)), f32(k_new)], 1)
  vals = jnp.concatenate([f32(gather_window(c.v[0], c.table, c.max_len)), f32(v_new)], 1)
  slot = jnp.arange(c.max_len)[None, None, :] < c.lengths[:, None, None]
  mask = jnp.concatenate([jnp.broadcast_to(slot, (rows, t, c.max_len)),
                          jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (rows, t, t))], 2)
  want = jax.jit(attend)(f32(q), keys, vals, mask)
  return float(jnp.abs(f32(got) - want).max())


# ----------------------------------------------------------------------------------- the child
def child(args) -> int:
  """Runs this flag set's cells, printing one `CELL {json}` line per cell."""
  import functools

  import jax
  import jax.numpy as jnp

  from tlt_jax.bench.roofline import copy_bandwidth, kv_bytes_per_token
  from tlt_jax.drafter.model import drafter_cache, init_drafter
  from tlt_jax.models import (ModelConfig, fuse_projections, init_cache, init_params,
                              unstack_layers)
  from tlt_jax.rollout import decode, spec_state, speculative
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.scheduler import kv_bucket
  from tlt_jax.rollout.policies.strategy import Strategy

  cells = json.loads(args.child)
  d, n, k, f, layers, v = (int(x) for x in args.shape.split(","))
  cfg = ModelConfig(arch="qwen2", vocab_size=v, hidden_size=d, intermediate_size=f,
                    num_layers=layers, num_heads=n, num_kv_heads=k, head_dim=d // n,
                    qkv_bias=True, tie_word_embeddings=True, dtype=args.dtype,
                    param_dtype=args.dtype)
  emit = lambda **kw: print("CELL " + json.dumps(kw), flush=True)
  bw = copy_bandwidth()
  emit(kind="bandwidth", bytes_per_s=bw, device=str(jax.devices()[0].device_kind),
       jax=jax.__version__, flags=os.environ.get("XLA_FLAGS", ""))
  # eagerly, leaf by leaf: one jit of the whole init made XLA:GPU compile for minutes (seen
  # on an H200: its threefry over 1.1B values never finished compiling in 100 s)
  base = unstack_layers(init_params(cfg, jax.random.key(0)))
  fused = None
  dparams = jax.tree.map(lambda x: x.astype(cfg.weight_dtype),
                         init_drafter(cfg, jax.random.key(1)))
  wbytes = sum(x.nbytes for x in jax.tree.leaves(base))  # tied: the head is the embedding
  head_bytes = base["embed"].nbytes
  dbytes = sum(x.nbytes for x in jax.tree.leaves(dparams))
  kvt = kv_bytes_per_token(cfg, cfg.compute_dtype)
  greedy = SamplingParams(temperature=0.0)
  prompt_len = 64
  cache_len = prompt_len + args.iters * 8 + 64  # room for a spec chunk's reach
  def rand_cache(c):  # KV pools of random values (never time on zeros), rows at prompt_len
    fill = jax.jit(lambda x, key: jax.random.normal(key, x.shape, x.dtype))
    k = tuple(fill(x, jax.random.key(i)) for i, x in enumerate(c.k))
    return c.replace(k=k, v=k, lengths=jnp.full((c.batch_size,), prompt_len, jnp.int32))

  slowest = 0.0  # seconds of the slowest cell so far: a cell is started only if one as slow
  for code, b in cells:  # would still end before the deadline
    if args.deadline and time.time() + slowest > args.deadline:
      emit(kind="cell", code=code, batch=b, error="skipped: out of --budget_s")
      continue
    c = parse_code(code)
    ccfg = cfg.replace(cache_attention="paged") if c["paged"] else cfg
    if c["fused"] and fused is None:
      fused = jax.jit(functools.partial(fuse_projections, cfg=cfg))(base)
    params = fused if c["fused"] else base
    hidden = jax.random.normal(jax.random.key(2), (b, d), cfg.compute_dtype)
    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(b))
    state = decode.DecodeState(
        cache=rand_cache(init_cache(cfg, b, cache_len)), hidden=hidden, keys=keys,
        num_generated=jnp.zeros((b,), jnp.int32), max_new=jnp.full((b,), 1 << 30, jnp.int32),
        done=jnp.zeros((b,), jnp.bool_), stopped=jnp.zeros((b,), jnp.bool_))
    t0 = time.perf_counter()
    try:
      if c["arm"] is None:
        iters = args.iters
        # paged: the one window (the whole cache), each row's live slots read (their mean)
        kv_len = cache_len if c["paged"] else kv_bucket(prompt_len + iters, 16, cache_len)
        read = prompt_len + iters // 2 if c["paged"] else kv_len
        fn = lambda a, it: decode.decode_chunk(
            a[0], a[1], cfg=ccfg, sp=greedy, stop_tokens=(), chunk=it, capture_hidden=False,
            kv_len=kv_len, early_exit=c["early_exit"], unroll=c["unroll"])
        step_bytes = wbytes + b * read * kvt
        args_ = (params, state)
      else:
        st = Strategy(c["arm"])
        iters = max(args.iters // 4, 4)
        reach = prompt_len + speculative.chunk_reach(st, iters)
        kv_len = cache_len if c["paged"] else kv_bucket(reach, 16, cache_len)
        read = (prompt_len + reach) // 2 if c["paged"] else kv_len
        dc = rand_cache(drafter_cache(cfg, b, cache_len))
        m = st.steps + 1
        sstate = spec_state.SpecState(
            base=state, dcache=dc.replace(lengths=dc.lengths - 1),
            pending=jnp.zeros((b,), jnp.int32), has_pending=jnp.zeros((b,), jnp.bool_),
            catch_tokens=jnp.zeros((b, m), jnp.int32),
            catch_hidden=jnp.zeros((b, m, d), cfg.compute_dtype),
            catch_count=jnp.zeros((b,), jnp.int32))
        fn = lambda a, it: speculative.spec_chunk(
            *a, cfg=ccfg, sp=greedy, stop_tokens=(), chunk=it, strategy=st,
            capture_hidden=False, kv_len=kv_len)
        # the target's weights once (one verification forward), the drafter and the head it
        # reads once per draft step; both KV windows (the drafter's: one layer)
        step_bytes = (wbytes + st.steps * (dbytes + head_bytes)
                      + b * read * kvt * (1 + 1 / cfg.num_layers))
        args_ = (params, dparams, sstate)
      exe = jax.jit(fn, static_argnums=1).lower(args_, iters).compile(
          compiler_options=compiler_options(c))
      compile_s = time.perf_counter() - t0
      jax.block_until_ready(exe(args_))
      step_s = float("inf")
      for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(exe(args_))
        step_s = min(step_s, (time.perf_counter() - t) / iters)
      mem = exe.memory_analysis()
      mem_bytes = (None if mem is None else int(mem.argument_size_in_bytes
                                                + mem.output_size_in_bytes
                                                + mem.temp_size_in_bytes))
      prof = None
      if c["profile"]:  # a trace that fails (no CUPTI, say) costs the trace, not the cell
        from tlt_jax.profiling import kernel_profile
        try:
          prof = kernel_profile(lambda: jax.block_until_ready(exe(args_)), iters)
        except Exception as e:  # noqa: BLE001
          prof = {"wall_s": step_s, "lines": [], "error": f"trace failed: {type(e).__name__}: "
                  f"{str(e)[:200]}"}
      parity = (paged_parity(cfg, state.cache, b, 1 if c["arm"] is None else st.steps + 1)
                if c["paged"] else None)
      emit(kind="cell", code=code, batch=b, kv_len=kv_len, step_s=step_s, profile=prof,
           paged_parity=parity,
           bytes=step_bytes, fraction=step_bytes / step_s / bw, compile_s=compile_s,
           seconds=time.perf_counter() - t0, memory_bytes=mem_bytes,
           shape_bytes=wbytes + b * cache_len * kvt)
    except Exception as e:  # noqa: BLE001 - a variant that fails here is a finding
      emit(kind="cell", code=code, batch=b, error=f"{type(e).__name__}: {str(e)[:300]}")
    slowest = max(slowest, time.perf_counter() - t0)
  stats = jax.devices()[0].memory_stats() or {}
  emit(kind="peak", peak=stats.get("peak_bytes_in_use"), limit=stats.get("bytes_limit"),
       weights=wbytes)
  return 0


# ---------------------------------------------------------------------------------- the parent
def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--iters", type=int, default=64)
  ap.add_argument("--shape", default="4096,128,64,11008,6,32",
                  help="hidden,heads,kv_heads,mlp,layers,vocab")
  ap.add_argument("--quick", action="store_true", help="one cell of each kind (CPU smoke)")
  ap.add_argument("--flag_sets", default="", help="comma-separated subset of the flag sets")
  ap.add_argument("--out", default=os.path.join(ROOT, "out", "gpu_decode"))
  ap.add_argument("--budget_s", type=float, default=0.0, help="start no cell that would end "
                  "after this many seconds, judged by the slowest cell so far (0: no limit): "
                  "a time-boxed stage still prints its summary")
  ap.add_argument("--child", default="", help=argparse.SUPPRESS)
  ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    return child(args)

  plan = QUICK_PLAN if args.quick else PLAN
  only = [s for s in args.flag_sets.split(",") if s]
  sets = [s for s in FLAG_SETS if any(p[0] == s for p in plan) and (not only or s in only)]
  print(f"## Decode against the bandwidth limit ({args.dtype}, shape {args.shape}, "
        f"{args.iters} steps a loop)\n\n| XLA flags | code | batch | kv_len | step ms | MB a step "
        "| GB/s | % of copy bw | memory MiB (shapes) | compile s |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
  results = {"dtype": args.dtype, "shape": args.shape, "flag_sets": {}}
  deadline = time.time() + args.budget_s if args.budget_s else 0.0
  slowest = 0.0  # the slowest cell's seconds so far (a new process's start-up comes on top)
  for name in sets:
    if deadline and time.time() + slowest > deadline:
      print(f"| {name} | (skipped: out of --budget_s) ||||||||", flush=True)
      continue
    cells = [(code, b) for s, code, bs in plan if s == name for b in bs]
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " "
                                       + FLAG_SETS[name]).strip()}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cells),
           "--dtype", args.dtype, "--iters", str(args.iters), "--shape", args.shape,
           "--deadline", str(deadline)]
    got = results["flag_sets"][name] = {"cells": []}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    tail: list[str] = []
    for line in proc.stdout:
      if not line.startswith("CELL "):
        tail = (tail + [line.rstrip()])[-8:]
        continue
      r = json.loads(line[5:])
      slowest = max(slowest, r.get("seconds", 0.0))
      if r["kind"] == "bandwidth":
        got.update(bandwidth=r["bytes_per_s"], device=r["device"], jax=r["jax"])
      elif r["kind"] == "peak":
        got["peak"] = r
      elif "error" in r:
        got["cells"].append(r)
        print(f"| {name} | {r['code']} | {r['batch']} | fails: {r['error'][:120]} ||||||||",
              flush=True)
      else:
        got["cells"].append(r)
        mem = ("-" if r["memory_bytes"] is None else
               f"{r['memory_bytes'] / 2**20:.0f} ({r['shape_bytes'] / 2**20:.0f})")
        code = r["code"] + ("" if r.get("paged_parity") is None
                            else f" (max diff vs XLA {r['paged_parity']:.1e})")
        print(f"| {name} | {code} | {r['batch']} | {r['kv_len']} | "
              f"{r['step_s'] * 1e3:.3f} | {r['bytes'] / 1e6:.0f} | "
              f"{r['bytes'] / r['step_s'] / 1e9:.0f} | {r['fraction']:.0%} | {mem} | "
              f"{r['compile_s']:.1f} |", flush=True)
      save(args.out, results)  # as it goes: a stage cut off at its limit keeps these cells
    rc = proc.wait()
    if rc:
      print(f"\n{name}: exit {rc}; its last lines:\n```\n" + "\n".join(tail) + "\n```\n",
            flush=True)
  for name, g in results["flag_sets"].items():
    for r in g["cells"]:
      if r.get("profile"):
        from tlt_jax.profiling import markdown
        print("\n" + markdown(f"{name}, {r['code']}, batch {r['batch']}", r["profile"]),
              flush=True)
  print("\ncopy bandwidth per process (in-place x + 1 over 1 GiB, read + write): "
        + ", ".join(f"{n} {g['bandwidth'] / 1e9:.0f} GB/s"
                    for n, g in results["flag_sets"].items() if "bandwidth" in g), flush=True)
  best = summarize(results)
  save(args.out, results)
  return 0 if best else 1


def save(out: str, results: dict) -> None:
  """OUT/gpu_decode.json, with the fastest plain variant per batch so far (`fastest`),
  written whole each time (a temporary file renamed: a kill mid-write leaves the last one)."""
  results["best"] = {b: {"flags": n, **c} for b, (n, c) in fastest(results).items()}
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "gpu_decode.json")
  with open(path + ".tmp", "w") as f:
    json.dump(results, f, indent=1)
  os.replace(path + ".tmp", path)


def fastest(results: dict) -> dict[int, tuple[str, dict]]:
  """{batch: (flag set, cell)}: the fastest plain (not speculative) cell of each batch."""
  best: dict[int, tuple[str, dict]] = {}
  for n, g in results["flag_sets"].items():
    for c in g["cells"]:
      if "error" in c or "spec" in c["code"]:
        continue
      if c["batch"] not in best or c["step_s"] < best[c["batch"]][1]["step_s"]:
        best[c["batch"]] = (n, c)
  return best


def summarize(results: dict) -> dict:
  """The fastest plain variant per batch, its share of copy bandwidth and its speedup over
  the engine as it runs with XLA's defaults; prints the section, returns {batch: cell}."""
  base = {c["batch"]: c for c in results["flag_sets"].get("default", {}).get("cells", [])
          if "error" not in c and c["code"].replace(" profile", "") == "engine"}
  best = fastest(results)
  print("\n### Fastest plain decode per batch\n\n| batch | XLA flags | code | step ms | "
        "% of copy bw | vs engine on XLA defaults |\n|---:|---|---|---:|---:|---:|")
  for b in sorted(best):
    n, c = best[b]
    ref = base.get(b)
    gain = f"{ref['step_s'] / c['step_s']:.2f}x" if ref else "-"
    print(f"| {b} | {n} | {c['code']} | {c['step_s'] * 1e3:.3f} | {c['fraction']:.0%} | "
          f"{gain} |")
  autotuning(results)
  return best


def autotuning(results: dict) -> None:
  """Prints each `noautotune` cell beside the cell of the same code and batch with the
  matmuls autotuned: step ms and compile s of both (module docstring: the first compile of a
  shape is the one that autotunes)."""
  cells = {(c["code"].replace(" profile", ""), c["batch"]): c
           for g in results["flag_sets"].values() for c in g["cells"] if "error" not in c}
  rows = [(code, b, cells[(code.replace(" noautotune", ""), b)], c)
          for (code, b), c in cells.items()
          if "noautotune" in code and (code.replace(" noautotune", ""), b) in cells]
  if not rows:
    return
  print("\n### Autotuning the matmuls: a step and a compile\n\n| code | batch | step ms tuned / "
        "not | compile s tuned / not |\n|---|---:|---:|---:|")
  for code, b, tuned, plain in rows:
    print(f"| {code.replace(' noautotune', '')} | {b} | {tuned['step_s'] * 1e3:.3f} / "
          f"{plain['step_s'] * 1e3:.3f} | {tuned['compile_s']:.1f} / {plain['compile_s']:.1f} |")


if __name__ == "__main__":
  sys.exit(main())
