#!/usr/bin/env python
"""The EAGLE export of a finished run's drafter, for vLLM or SGLang.

    python scripts/export_drafter.py --workdir workdirs/default [--step N] \
        --engine sglang|vllm [--out DIR]

Reads the run's config.json (the target model) and its checkpoint at --step (default: the
latest) and writes model.safetensors + config.json to --out (default:
<workdir>/drafter_eagle/<step>, where training writes its own exports:
tlt_jax/drafter/export.py). A TLT run already holds one per checkpoint for
config.train.export_engine; this is for the other engine or a run made without it.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, help="the workdir of a tlt_jax.train run")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  p.add_argument("--engine", required=True, help="sglang or vllm (vllm: Llama targets only)")
  p.add_argument("--out", default=None, help="default: <workdir>/drafter_eagle/<step>")
  args = p.parse_args(argv)
  from tlt_jax.drafter.export import ExportError, export_run
  try:
    out = export_run(args.workdir, step=args.step, engine=args.engine, out=args.out)
  except ExportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out}/model.safetensors and {out}/config.json ({args.engine})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
