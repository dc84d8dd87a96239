"""Benchmark harnesses the scripts and the tests share: the widened bench target
(bench_model), per-forward speculative costs and speedup bounds (spec_costs), decode steps
against copy bandwidth (roofline), the Hugging Face peers (rollout), the regime benchmark
(regime) and where a greedy arm's outputs part from plain decoding's, near-tie or bug
(divergence), the transformers parity check (hf_parity), the history index at scale
(history), history drafts vs the drafter under one bandit (history_arms), the strategy
selectors on the long tail (mab), the drafter against a moving policy (drift), attention
windows against executables (windows), the verification kernels against XLA
(verify_kernels) and runs in lockstep (lockstep: scripts/bench_e2e.py's drift-free
comparison). The scripts in scripts/ are their command lines."""
