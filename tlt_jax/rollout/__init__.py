"""The rollout: an engine that decodes a worker's share of requests, the policies that decide
how, and the sources that draft from what was already written.

This package is the engine's mechanics: `engine.py` (one replica's `generate`, sequencing the
rest once per chunk; `call.py` its record of one call), `replica.py` (the replica's weights,
pools and device calls: the seam the simulator replaces), `scheduler.py` (which rows to
prefill, refill, compact), `pages.py` (the paged KV cache's allocator), `prefill.py` (a
prefill, and a preempted row's resume), `decode.py` (plain decode chunks), `spec_state.py`
(the speculative state: entering it, leaving it), `speculative.py` and `drafts.py`
(speculative chunks: the drafter's chains and trees, verification), `history_chunk.py` (a
history arm's host loop), `compile_plan.py` (with its parts `windows.py`, `switching.py`,
`readiness.py` and `plain_ahead.py`),
`plan_call.py` and `executables.py` (what is compiled, when, and at what price; `sharing.py`:
each program compiled once for the process, or the job: `port.py` loads one worker's
executable onto another's devices, `exchange.py` another process's), `records.py`
(requests, results, chunk metrics), `sampling.py`, `config.py`.
Its two subpackages:
  policies/  the decisions (the bandit, the speculation gate and its pricing, the arm):
             pure host values and transitions; they import no engine module. The engine
             takes their states per call, in cells its caller owns (policies/cells.py).
  sources/   draft sources from text already written (the history index); they import
             neither the engine nor the policies.
The engine imports both. tests/test_tree.py checks these rules.
"""
