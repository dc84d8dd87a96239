"""The embedded default: GRPO on the shipped tiny Qwen2 model and the synthetic long-tail
arithmetic task, with TLT's speculative rollout (shipped warm-started drafter) and spot
drafter training on the idle one of two rollout workers. Runs on a 2-core CPU in 3 to 7
minutes, as fast or slow as the machine is that day (JAX 0.12, cold compilation cache), with
no downloads:

  python -m tlt_jax.train --config configs/default.py
  python -m tlt_jax.train --config configs/default.py --config.tlt.enabled=False   # baseline
  python -m tlt_jax.eval --config configs/default.py --config.eval.num_prompts=50
"""

import ml_collections

from tlt_jax.config import asset_path


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.workdir = "workdirs/default"
  # On a CPU-only host, expose this many CPU devices (XLA's host device count) so each
  # rollout worker has its own; 0 leaves JAX's default. Ignored where accelerators exist.
  c.cpu_devices = 2
  # JAX's persistent compilation cache: a second run of a config compiles nothing ("": off)
  c.compilation_cache = "~/.cache/tlt_jax/jax"

  # Multi-process (multi-host) start-up, tlt_jax/distributed.py. The defaults detect a launch
  # by srun (one task per GPU or per node) or mpirun; a launch by hand gives the coordinator,
  # the process count and this process's id here (or in TLT_COORDINATOR_ADDRESS,
  # TLT_NUM_PROCESSES, TLT_PROCESS_ID).
  c.distributed = ml_collections.ConfigDict({
      "enabled": "auto",  # auto: when srun/mpirun started > 1 process or a coordinator is set
      "coordinator_address": "",  # HOST:PORT of process 0 ("": detected; Slurm: first node)
      "num_processes": 0,  # 0: from the launcher
      "process_id": -1,  # -1: from the launcher
      # GPUs this process uses: "" = its share of the node's GPUs when several processes share
      # a node (one per GPU), else all; "all"; or ordinals like "0,1"
      "local_device_ids": "",
      "initialization_timeout": 300,  # s to wait for every process to connect
      # s without a heartbeat after which a process counts as dead and the whole job aborts
      # (the bound on how long the others can hang on a killed process)
      "heartbeat_timeout": 60,
      "shutdown_timeout": 300,  # s a finished process waits at exit for the others
  })

  c.model = ml_collections.ConfigDict()
  c.model.path = asset_path("default", "model")
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"
  c.model.remat = False  # rematerialise each layer in the backward pass (long sequences)
  # what it keeps: "full" (each layer's input only: the least memory, the backward recomputes
  # the forward) or "dots" (every projection's output too: no matmul recomputed)
  c.model.remat_policy = "full"
  # the learner's attention over packed rows: "auto" (a fused flash-attention kernel on a GPU
  # in bf16/fp16, XLA's reference elsewhere; the run logs which and why), "fused", "xla"
  c.model.attention = "auto"
  # a mixture of experts' grouped experts (prefill, the learner; models/moe.py): "auto" (a
  # Pallas grouped-matmul kernel on a GPU, after its start-up check; XLA's ragged_dot
  # elsewhere), "kernel", "xla"
  c.model.experts = "auto"
  # a shipped architecture (tlt_jax/assets/architectures/) for scripts/plan_memory.py when
  # model.path is not on this machine: "qwen2.5-7b", "qwen3-8b", "qwen2.5-32b", "llama-3.3-70b",
  # "qwen3-30b-a3b"
  c.model.architecture = ""
  # LoRA (tlt_jax/models/lora.py): rank > 0 trains low-rank adapters of the targets
  # ("all-linear", or some of q,k,v,o,gate,up,down / q_proj..down_proj) over the frozen
  # model, scaled by alpha / rank: the learner holds the base once in model.dtype and Adam
  # moments for the adapters alone, the base is the KL reference, the rollout decodes the
  # merged weights; 0: the whole model is trained. init: a PEFT adapter directory (e.g. an SFT
  # LoRA's, or `python -m tlt_jax.export`'s OUT/adapter) to start from instead of B = 0; its
  # r, lora_alpha and target_modules must be rank, alpha and targets
  c.model.lora = ml_collections.ConfigDict({"rank": 0, "alpha": 32.0, "targets": "all-linear",
                                            "init": ""})

  # The per-device memory plan (tlt_jax/memory.py, scripts/plan_memory.py): the run refuses to
  # start when a phase does not fit. device: "" = this machine's (a GPU's allocator limit; no
  # limit on CPU), or a kind ("h100", "a100-40gb", "80gb") to plan for; fraction: the share of
  # it the run may use (match XLA_PYTHON_CLIENT_MEM_FRACTION); num_devices: 0 = visible ones.
  # release_rollout_weights: workers free their actor copy after the rollout (the weight sync
  # after the update brings the new one), so the log-prob and update phases do not hold it.
  c.memory = ml_collections.ConfigDict({"device": "", "fraction": 0.9, "num_devices": 0,
                                        "check": True, "release_rollout_weights": True})

  # The learner's mesh over the first `devices` devices (0: all). On the 2-core CPU one device
  # (XLA's multi-threaded kernels) runs the update 2x faster than FSDP over the two host
  # devices the rollout workers use (measured: 4.7 s vs 9.6 s per RL step's update).
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1, "devices": 1})

  c.data = ml_collections.ConfigDict()
  # one file, or several comma-separated (concatenated in order; each one's training accuracy
  # apart: a row without a data.source_key source takes its file's name)
  c.data.train_path = asset_path("default", "data", "train.jsonl")
  # several files mixed by weight: one per file, e.g. "0.7,0.3", each file's share of the
  # prompts an epoch draws (a small file with a large weight repeats, a large one with a small
  # weight is subsampled); "": the files concatenated, each prompt once an epoch
  c.data.train_weights = ""
  c.data.shuffle = True  # False: each epoch in the files' order (a curriculum they hold)
  # held out: one file, or several comma-separated (each one's accuracy reported apart, e.g.
  # --config.data.test_path=/data/aime24.jsonl,/data/math500.jsonl)
  c.data.test_path = asset_path("default", "data", "test.jsonl")
  # field names, or dotted paths into nested fields (verl's files: prompt_key="prompt",
  # answer_key="reward_model.ground_truth", source_key="data_source"; configs/verl_math.py)
  c.data.prompt_key = "prompt"
  c.data.answer_key = "answer"
  c.data.source_key = ""  # optional per-row source field (accuracy is logged per source)
  c.data.on_bad_row = "skip"
  c.data.max_prompt_len = 80
  c.data.chat_template = False  # True: wrap prompts with the tokenizer's chat template
  c.data.system_prompt = ""

  c.reward = ml_collections.ConfigDict()
  # "arith" (this task), "math" (math-verify), "package.module:function" or
  # "path/to/file.py:function": fn(response, answer), or verl's signature
  # fn(data_source, solution_str, ground_truth, extra_info=None) (tlt_jax/rl/rewards.py)
  c.reward.name = "arith"
  c.reward.num_workers = 2  # reward processes; a crashing/hanging call scores 0 and is counted
  c.reward.timeout = 10.0  # seconds per call
  # DAPO's soft overlong punishment: a response in the last overlong_buffer tokens of
  # rollout.max_new_tokens loses up to overlong_penalty, linearly, all of it at the budget (0: off)
  c.reward.overlong_buffer = 0
  c.reward.overlong_penalty = 1.0

  c.rollout = ml_collections.ConfigDict()
  c.rollout.max_batch = 64  # sequences one worker decodes at once; 0: size it from memory
  c.rollout.buckets = (1, 2, 4, 8, 16, 32, 64)
  c.rollout.chunk_size = 16
  # prompts are padded to a multiple of this: one prefill shape per batch bucket here (the
  # prompts are short; every extra shape is an executable to compile)
  c.rollout.prompt_bucket = 80
  c.rollout.compaction = True
  # the plain executables of the buckets a batch compacts into compiled on each worker's
  # compile thread while it decodes, largest first, not in the tail's time when it gets there
  # (rollout/plain_ahead.py; with paged attention)
  c.rollout.compile_ahead = True
  # The paged KV cache (tlt_jax/rollout/pages.py): slots per page, pages in a replica's pool
  # (0: max_batch rows of max length, never waiting for pages), and the mean row length
  # (prompt + response so far) the memory plan sizes max_batch = 0 by (0: the max length).
  c.rollout.page_size = 16
  c.rollout.kv_pages = 0
  c.rollout.mean_live_tokens = 0
  # attention over the cache: "paged", each row's live pages read in place (one window; a
  # Pallas kernel on GPUs, its XLA form elsewhere: tlt_jax/kernels/paged_attention.py; 1.09x
  # the main job on a 2-core CPU, 0.97-1.08x the windows' decode step on an H200); "windows",
  # the window's pages gathered (an executable per window); "auto": paged, on a GPU where the
  # kernel passes its start-up check (else the windows, the reason at start-up)
  c.rollout.attention = "auto"
  c.rollout.max_new_tokens = 288
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  # rollout replicas, each on its own tensor_parallel devices; 0: one per such group of the
  # visible devices (2 on this config's 2 CPU devices, 1 on one GPU)
  c.rollout.num_workers = 0
  c.rollout.tensor_parallel = 1  # devices per replica

  c.grpo = ml_collections.ConfigDict()
  c.grpo.num_prompts = 32  # prompts per RL step
  c.grpo.n = 8  # responses per prompt (the group)
  c.grpo.eps_low = 0.2
  c.grpo.eps_high = 0.28
  # the importance ratio (VeRL's policy_loss.loss_mode): "vanilla" (PPO's, per token) or
  # "gspo" (GSPO's, per response: its paper clips it at eps_low 3e-4, eps_high 4e-4)
  c.grpo.loss_mode = "vanilla"
  c.grpo.clip_ratio_c = 0.0  # > 1: dual-clip PPO (VeRL's clip_ratio_c, 3.0 there); 0: off
  c.grpo.kl_coef = 0.0  # > 0: a KL term to the initial model
  # its estimator, VeRL's kl_loss_type: "low_var_kl" (k3), "kl" (k1), "mse" (k2), "abs"
  c.grpo.kl_loss_type = "low_var_kl"
  c.grpo.entropy_coef = 0.0  # > 0: an entropy bonus in the loss (VeRL's entropy_coeff)
  # the rollout's sampling distribution corrected for (tlt_jax/rl/mismatch.py): "" off,
  # "token" / "sequence" / "geometric" truncated importance weights at most rollout_is_cap
  # (VeRL's rollout correction; its threshold 2.0); the distance is measured every step
  # either way
  c.grpo.rollout_is = ""
  c.grpo.rollout_is_cap = 2.0
  c.grpo.norm_adv_by_std = True
  # "grpo" ((r - group mean) / group std), "rloo" (leave-one-out baseline),
  # "reinforce_plus_plus_baseline" (r - group mean, whitened over the batch's tokens)
  c.grpo.adv_estimator = "grpo"
  # how the loss aggregates its token terms over a mini-batch: "token-mean" (DAPO),
  # "seq-mean-token-mean" (GRPO), "seq-mean-token-sum", "seq-mean-token-sum-norm" (Dr. GRPO,
  # with norm_adv_by_std=False; each response's sum over loss_norm_len, 0: max_new_tokens)
  c.grpo.loss_agg = "token-mean"
  c.grpo.loss_norm_len = 0
  # DAPO's overlong filtering: responses cut at rollout.max_new_tokens carry no loss (their
  # group's advantages still count them)
  c.grpo.drop_truncated = False
  # DAPO's dynamic sampling: a group whose rewards (with the overlong penalty) are all equal
  # has no advantage; filter_groups drops such groups and rolls out gen_prompts prompts at a
  # time (0: num_prompts; DAPO's gen batch), the same policy, until num_prompts groups with
  # signal are kept, at most max_rollouts rollouts a step (then it learns from those it has)
  c.grpo.filter_groups = False
  c.grpo.gen_prompts = 0
  c.grpo.max_rollouts = 4
  c.grpo.adv_eps = 1e-6
  c.grpo.micro_batch = 64  # rows per learner forward/backward (gradient accumulation)
  c.grpo.micro_batch_tokens = 2048  # > 0: rows per micro-batch = this // its padded length
  c.grpo.minibatches = 2  # optimizer steps per RL step (per pass: ppo_epochs)
  c.grpo.ppo_epochs = 1  # passes over the step's mini-batches (VeRL's ppo_epochs)
  c.grpo.pad_multiple = 32  # micro-batches are padded to this x 2^k tokens
  # rows of the max length while the samples left fill a micro-batch of them, then buckets
  # (max_len: one shape for most micro-batches, less padding), or length buckets only
  # (pad_multiple x 2^k: a row's attention over its whole T x T costs less); auto: max_len
  # where the fused attention computes only each segment's blocks (a GPU), else buckets
  c.grpo.row_layout = "auto"  # auto | max_len | buckets
  c.grpo.logit_chunk = 1024

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 5e-5
  c.optim.schedule = "constant"  # after linear warm-up; or "cosine"
  c.optim.warmup_steps = 4
  c.optim.weight_decay = 0.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.99
  c.optim.grad_clip = 1.0

  c.train = ml_collections.ConfigDict()
  c.train.steps = 40
  c.train.eval_every = 10  # held-out greedy accuracy every N steps (0: never)
  c.train.checkpoint_every = 5
  c.train.keep_checkpoints = 2
  # a run resumed from its workdir's checkpoint with other values of what it learns (model,
  # data, reward, sampling, GRPO, optimizer, seed: workdir.LEARNING_KEYS) stops with an error
  # naming them; True continues it with the new values (the earlier config.json kept)
  c.train.resume_with_changes = False
  # with every checkpoint of a TLT run, the drafter's EAGLE export for this serving engine in
  # <workdir>/drafter_eagle/<step>/ (tlt_jax/drafter/export.py): "sglang" (Llama, Qwen2, Qwen3
  # targets) or "vllm" (Llama targets only)
  c.train.export_drafter = True
  c.train.export_engine = "sglang"
  # the policy as a Hugging Face folder, <workdir>/policy_hf/<step>/ (tlt_jax/export.py): "final"
  # (the last checkpoint's, at the end of the run), "every" (every checkpoint's, the newest
  # keep_checkpoints kept; a synchronous gather and write each time) or "none"; in
  # export_dtype ("": the starting model's config.json torch_dtype, else model.param_dtype)
  c.train.export_policy = "final"
  c.train.export_dtype = ""
  # the policy of the best held-out evaluation so far as <workdir>/policy_hf/best/ (best.json:
  # its step and score), rewritten when an evaluation beats every earlier one, the starting
  # policy's included: "accuracy" (every held-out prompt's), "accuracy:<source>" (one test
  # file's: its name without the extension), or "" (none)
  c.train.export_best = ""
  # the first N prompts' groups of each step's rollout, every response with its prompt, answer
  # and reward, in <workdir>/rollouts.jsonl (0: none)
  c.train.log_rollouts = 2
  # a process alive but making no progress for this many seconds (no chunk decoded, no
  # micro-batch stepped, no tensor exported, no phase begun: a collective whose peer never
  # comes, a stuck filesystem) prints every thread's stack, writes it to
  # <workdir>/hang.<process>.txt and exits 75, so the job ends and the same command resumes
  # from the newest checkpoint (tlt_jax/watchdog.py); 0: never. Above the longest compile.
  c.train.hang_timeout_s = 1800.0

  # a profiler trace of RL steps "N" or "N-M" ("": none) into <workdir>/tb (TensorBoard's
  # Profile tab; perfetto_trace.json.gz for ui.perfetto.dev; summary.md): tlt_jax/profiling.py
  c.profile = ml_collections.ConfigDict()
  c.profile.steps = ""

  # Weights & Biases (tlt_jax/wandb_log.py; `pip install wandb`): every scalar of
  # metrics.jsonl, the logged responses as tables, this config. project "": off. mode:
  # "online", "offline" (upload later: wandb sync), "" (WANDB_MODE, else online); name "": the
  # workdir's folder name; tags comma-separated. A resumed run continues its wandb run.
  c.wandb = ml_collections.ConfigDict({"project": "", "entity": "", "name": "", "group": "",
                                       "tags": "", "mode": ""})

  c.tlt = ml_collections.ConfigDict()
  c.tlt.enabled = True  # False: the baseline (plain rollout, no drafter, no drafter training)
  c.tlt.drafter = ml_collections.ConfigDict()
  c.tlt.drafter.init = asset_path("default", "drafter")  # a saved drafter dir, or "init:SEED"
  # spot: trained on idle rollout workers until the rollout barrier; serial: `serial_steps`
  # steps after the policy update (on the critical path, the ablation); off: frozen
  c.tlt.drafter.mode = "spot"
  c.tlt.drafter.on_barrier = "finish"  # the in-flight step at the barrier: finish or drop
  c.tlt.drafter.serial_steps = 4
  # the spot trainer's: fresh windows every step, so a higher rate tracks a moving policy
  # without drifting on a still one (docs/drafter.md, the drift benchmark: at 3e-5 it
  # recovered ~50% of the frozen drafter's decay, at 3e-4 63-94%)
  c.tlt.drafter.lr = 3e-4
  c.tlt.drafter.warmup_steps = 0
  c.tlt.drafter.unroll = 1  # > 1: EAGLE-3 style training-time-test unroll
  c.tlt.drafter.rows = 8  # packed rows per drafter step
  c.tlt.drafter.row_len = 256  # tokens per packed row
  c.tlt.drafter.window = 128  # tokens per buffered window of a response
  # tokens before a window it attends to without a loss (the prompt, earlier response): the
  # context the drafter drafts with (tlt_jax/drafter/buffer.py); row_len >= window + context
  c.tlt.drafter.context = 128
  c.tlt.drafter.windows_per_response = 4
  c.tlt.drafter.buffer_tokens = 65536  # token budget of the drafter data buffer
  c.tlt.drafter.keep_steps = 2  # train on the windows of the last N RL steps
  c.tlt.drafter.tail_weight = 4.0  # weight of tokens decoded with speculation on
  # every step, the drafter's tokens per verification on this many of the step's responses
  # (each read up to data.max_prompt_len + acceptance_response_len tokens, prompt included:
  # one executable), read off them with a chain of acceptance_depth drafts at the rollout's
  # sampling settings (no decoding; metrics drafter_acceptance, the bar's draft_tpv:
  # staleness as it happens; 0: off)
  c.tlt.drafter.acceptance_sample = 8
  c.tlt.drafter.acceptance_depth = 4
  c.tlt.drafter.acceptance_response_len = 48
  c.tlt.spec = ml_collections.ConfigDict()
  c.tlt.spec.selector = "beg"  # BEG-MAB; or "fixed" (always `strategy`), "eg", "ucb1", "bucb1"
  # Bandit arms per live-batch bucket, "LOWER_BOUND:ARM,..."; "" = the defaults,
  # rollout.policies.mab.default_mab_buckets
  c.tlt.spec.buckets = ""
  c.tlt.spec.epsilon = 0.1
  c.tlt.spec.window = 300
  # every arm of a bucket is measured this many times before the bandit exploits (one chunk's
  # reward is noisy: at batch 1 it is one answer)
  c.tlt.spec.min_pulls = 5
  c.tlt.spec.strategy = "4_1_5"  # the fixed selector's arm
  # Each rollout worker keeps an index of this run's responses per prompt (siblings, earlier
  # steps: tlt_jax/rollout/sources/history.py), so history arms (hist_<K>,
  # histtree_<K>_<topk>_<N>) in tlt.spec.buckets can draft from it; host-side work only.
  c.tlt.spec.history = True
  c.tlt.spec.precompile = False  # True: compile every choosable (bucket, arm) pair up front
  # Compile them in the background instead, speculating at a bucket once its arms are ready
  c.tlt.spec.background_compile = True
  # A cap on the live batch speculation may run at (0: none; the gate finds where drafts pay).
  # 4 on this CPU: a chunk of more rows is compute-bound here (no draft can pay; the gate
  # would measure as much from plain decoding's steps and compile nothing), and the bandit's
  # buckets above it would be host work for nothing. The 7B/32B/70B recipes set no cap.
  c.tlt.spec.bs_threshold = 4
  c.tlt.spec.patience = 2
  c.tlt.spec.max_steps = 0
  # Open speculation bucket by bucket where it is measured to beat plain decoding by
  # `margin` (per-row tokens/s over `min_chunks` chunks); one worker probes, with `strategy`
  # first, the others compile a bucket's arms only once it pays. Probation goes where the
  # rollout's time is: to the bucket whose seconds per step x best-case saving is largest (the
  # best case bounded by plain decoding's measured step times), moving after `follow_traffic`
  # rollouts without a chunk there. A bucket declined because the drafts' acceptance fell
  # short is probed again every `reprobe_every` rollouts (the drafter keeps training); one
  # declined because no draft could pay on this hardware every `hardware_reprobe_every`
  # (spot training pauses meanwhile). Not with selector="fixed" (the pinned strategy always).
  # Hardware verdicts are kept beside `compilation_cache` (tlt_gate/verdicts.json): a later
  # run of this config on this kind of machine starts with them and probes nothing
  # (tlt_jax/rollout/policies/gate.py).
  # Nothing speculative is compiled unless its best case repays the compile within `payback`
  # of the run's steps left (tlt_jax/rollout/policies/payoff.py): the seconds the run spends at the
  # bucket per step x the steps left x payback x (1 - 1/ceiling) >= the compile, priced in
  # plain decode chunk compiles (`compile_factor` until one is measured). On this CPU the
  # long tail spends ~5 ms per step at bucket 1, so no arm is ever compiled here.
  # enabled=False: no probing, every bucket speculates with every arm and the drafter trains
  # from the first step; compiles are still priced (narrower attention windows).
  c.tlt.spec.gate = ml_collections.ConfigDict({
      "enabled": True, "min_chunks": 4, "margin": 0.05, "reprobe_every": 10,
      "hardware_reprobe_every": 40, "follow_traffic": 3, "payback": 0.5,
      "compile_factor": 3.0})

  c.eval = ml_collections.ConfigDict()
  # speculate during the run's held-out evaluation (lossless either way; off here: on this
  # CPU it would compile a second set of executables and not be faster); `python -m
  # tlt_jax.eval` decodes plainly whatever this says
  c.eval.speculate = False
  c.eval.num_prompts = 0  # each test file's first N prompts (0: all of them)
  c.eval.batch_size = 64
  # responses per prompt and their sampling: temperature 0 is greedy (n 1); n > 1 sampled
  # reports accuracy as avg@n and the unbiased pass@k (reasoning papers: n 16-32 at 0.6-1.0)
  c.eval.n = 1
  # each held-out source's first N prompts' responses at every evaluation, with their
  # rewards, in <workdir>/eval_responses.jsonl (0: none)
  c.eval.log_responses = 8
  c.eval.temperature = 0.0
  c.eval.top_p = 1.0
  return c
