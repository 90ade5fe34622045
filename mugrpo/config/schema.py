"""The config schema: one dataclass per section, each checking its own fields in ``validate()``.

Every default lives here and in :mod:`mugrpo.config.rollout_sections` (model, task, rollout, env:
the policy and what it generates); this module holds the sections about how it trains (schedule,
loss, optim, train, parallel, lora, checkpoint, eval, log) and :class:`Config`, which assembles
them all. Closed choices are Literal types; open ones (loss surrogates, ratio levels, aggregations,
corrections, task kinds, engines) are the names of their registries (:mod:`mugrpo.registry`), read
without importing torch, so a user's registered option is accepted. A field that a resume may
change carries ``metadata={"resume_safe": True}`` (listed by
:func:`mugrpo.config.rules.resume_safe_keys`).

Not here: the rules that span sections and the schedule arithmetic (:mod:`mugrpo.config.rules`),
reading YAML, ``key=value`` overrides and coercion (:mod:`mugrpo.config.io`), presets
(:mod:`mugrpo.config.presets`), derived quantities (:mod:`mugrpo.config.plan`). This module knows
nothing about models, engines' internals or tensors.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from mugrpo.algo.registries import (AGGREGATIONS, AGGREGATORS, CLIP_MODES, CORRECTIONS,
                                    RATIO_LEVELS, RATIO_MODES, SURROGATES, VETO_SCOPES)
from mugrpo.config.checks import SAFE, check, check_registered
from mugrpo.config.rollout_sections import (DEFAULT_FEW_SHOT, DEFAULT_INSTRUCTION, EnvConfig, ModelConfig,
                                            RemoteConfig, RolloutConfig, TaskConfig, VllmConfig)
from mugrpo.config.warmstart_section import WarmstartConfig
from mugrpo.errors import ConfigError

__all__ = [  # the sections of rollout_sections are re-exported: every section is importable from here
    "ADAPTIVE_GUARDS", "AGGREGATIONS", "MAX_ASYNC_STAGES", "BEHAVIOR_LOGPROBS", "CLIP_MODES", "DEFAULT_FEW_SHOT", "DEFAULT_INSTRUCTION",
    "LOGGERS", "LORA_DEFAULT_TARGETS", "RATIO_LEVELS", "VETO_NORMALIZERS", "VETO_SCOPES", "CheckpointConfig",
    "Config", "EnvConfig", "EvalConfig", "LogConfig", "LoraConfig", "LossConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig", "RemoteConfig", "RolloutConfig", "ScheduleConfig", "TaskConfig", "TrainConfig", "VllmConfig",
    "WarmstartConfig",
]


ADAPTIVE_GUARDS = ("none", "kl", "neg_ratio", "kl_or_neg_ratio")
"""``schedule.adaptive``: the drift guards that may end a stage early (:mod:`mugrpo.algo.adaptive`)."""


MAX_ASYNC_STAGES = 2
"""The bound of ``schedule.async_stages``: stage data lags the policy by at most this many stages."""


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
    async_stages: int = 0
    """k: stages generated ahead (docs/ALGORITHM.md section 3c, :mod:`mugrpo.stages.ahead`). 0: the
    synchronous loop (generate stage s, then optimise it). k >= 1: while the trainer optimises stage
    s, a background thread generates stages up to s + k from a copy of the weights taken at stage s's
    start, so stage data lags the policy by at most k stages (``stage/policy_lag_max``). At most
    ``MAX_ASYNC_STAGES`` (2). One process only; not with ``--replay`` nor
    ``loss.behavior_logprobs=trainer``."""

    def validate(self) -> None:
        for key in ("total_updates", "prompts_per_update", "micro_batch_tokens"):
            check(getattr(self, key) >= 1, f"schedule.{key}", "an integer >= 1", getattr(self, key))
        if self.micro_batch_size is not None:
            check(self.micro_batch_size >= 1, "schedule.micro_batch_size", "an integer >= 1 or null",
                   self.micro_batch_size)
        if self.updates_per_stage is None and self.num_stages is None:
            raise ConfigError("schedule.updates_per_stage and schedule.num_stages are both null; set one")
        if self.updates_per_stage is not None:
            check(self.updates_per_stage >= 1, "schedule.updates_per_stage", "an integer >= 1",
                   self.updates_per_stage)
        if self.num_stages is not None:
            check(self.num_stages >= 1, "schedule.num_stages", "an integer >= 1", self.num_stages)
        check(0 < self.adaptive_kl_max < math.inf, "schedule.adaptive_kl_max", "a finite number > 0 (nats per token)",
               self.adaptive_kl_max)
        check(0 < self.adaptive_neg_ratio_min <= 1, "schedule.adaptive_neg_ratio_min",
               "in (0, 1] (E[rho | A<0] starts at 1 and falls as the stage drifts)", self.adaptive_neg_ratio_min)
        check(self.adaptive_min_updates >= 1, "schedule.adaptive_min_updates", "an integer >= 1",
               self.adaptive_min_updates)
        check(isinstance(self.async_stages, int) and 0 <= self.async_stages <= MAX_ASYNC_STAGES,
              "schedule.async_stages", f"an integer in 0 .. {MAX_ASYNC_STAGES} (stages generated ahead; 0: "
              "synchronous)", self.async_stages)


VETO_NORMALIZERS = ("pre_veto", "post_veto")
BEHAVIOR_LOGPROBS = ("engine", "trainer")
"""The loss section's closed choices. Its open ones (``clip_mode``, ``ratio_level``, ``aggregation``)
are the names of the registries in :mod:`mugrpo.algo.registries` (``CLIP_MODES`` etc. are their
built-in names), checked in :meth:`LossConfig.validate`, so an option a user registers is accepted."""


@dataclass
class LossConfig:
    """The loss section. :class:`mugrpo.algo.losses.LossSettings` is built from it field by field, so a new
    loss option is a field here and its use in mugrpo/algo/losses.py, nothing else. A registered
    correction's parameters are fields too, added from their declaration in the registry
    (:data:`mugrpo.algo.registries.CORRECTIONS`): not written here."""

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
    def describe(self) -> str:
        """The clip range and ratio level in words (for the printed plan)."""
        clip = (f"M2PO (second-moment budget {self.m2po_budget:g})" if self.clip_mode == "m2po"
                else f"[{1 - self.clip_eps_low:g}, {1 + self.clip_eps_high:g}]")
        return clip if self.ratio_level == "token" else f"{clip} on the sequence-level ratio (GSPO)"

    def validate(self) -> None:
        for key, registry in (("clip_mode", SURROGATES), ("ratio_level", RATIO_MODES), ("aggregation", AGGREGATORS)):
            check_registered(getattr(self, key), registry, f"loss.{key}")
        check(0 <= self.clip_eps_low <= 1, "loss.clip_eps_low", "in [0, 1] (lower bound 1 - eps >= 0)",
               self.clip_eps_low)
        check(self.clip_eps_high >= 0, "loss.clip_eps_high", ">= 0", self.clip_eps_high)
        check(0 < self.veto_delta < 1, "loss.veto_delta", "in (0, 1)", self.veto_delta)
        check(self.m2po_budget > 0, "loss.m2po_budget", "> 0", self.m2po_budget)
        if self.dual_clip_c is not None:
            check(self.dual_clip_c > 1, "loss.dual_clip_c", "> 1 or null", self.dual_clip_c)
        check(self.kl_beta >= 0, "loss.kl_beta", ">= 0", self.kl_beta)
        check(self.adv_eps > 0, "loss.adv_eps", "> 0", self.adv_eps)
        check(0 < self.tis_cap < math.inf, "loss.tis_cap", "a finite number > 0 (the TIS weight's cap C, e.g. 2)",
               self.tis_cap)
        check_registered(self.correction, CORRECTIONS, "loss.correction")
        if "trainer_logprobs" in CORRECTIONS.needs(self.correction) and self.behavior_logprobs != "trainer":
            raise ConfigError(f"loss.correction={self.correction} reads the trainer's recomputed behaviour log-probs: "
                              "set loss.behavior_logprobs=trainer (docs/ALGORITHM.md section 5c)")
        for param in CORRECTIONS.all_params():  # each correction's own parameters, checked by their own rule
            value = getattr(self, param.name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and param.valid(value),
                  f"loss.{param.name}", param.accepted, value)


def _with_option_params(cls: type, registry) -> type:
    """``cls`` with a field for every parameter the registry's options declare (their defaults), so
    the config's keys, checks and reference come from the option that owns them."""
    return dataclasses.make_dataclass(cls.__name__, [(p.name, float, field(default=p.default))
                                                     for p in registry.all_params()],
                                      bases=(cls,), namespace={"__module__": cls.__module__, "__doc__": cls.__doc__})


LossConfig = _with_option_params(LossConfig, CORRECTIONS)


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
        check(self.lr > 0 and math.isfinite(self.lr), "optim.lr", "a finite number > 0", self.lr)
        for key in ("beta1", "beta2"):
            check(0 <= getattr(self, key) < 1, f"optim.{key}", "in [0, 1)", getattr(self, key))
        check(0 <= self.weight_decay < math.inf, "optim.weight_decay", "a finite number >= 0", self.weight_decay)
        check(0 < self.eps < math.inf, "optim.eps", "a finite number > 0", self.eps)
        check(self.max_grad_norm > 0, "optim.max_grad_norm", "> 0", self.max_grad_norm)
        check(self.warmup_updates >= 0, "optim.warmup_updates", ">= 0", self.warmup_updates)


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
            check(self.threads >= 1, "train.threads", ">= 1 or null", self.threads)


@dataclass
class ParallelConfig:
    """How a multi-process run (``torchrun --nproc_per_node N -m mugrpo train``) shards the policy.

    Applied from outside by :mod:`mugrpo.kit.distributed` (FSDP2 ``fully_shard`` per decoder layer, then
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
        check(self.timeout_s > 0, "parallel.timeout_s", "> 0 seconds", self.timeout_s)


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
        check(self.rank >= 0, "lora.rank", "an integer >= 0 (0 = off)", self.rank)
        check(0 < self.alpha < math.inf, "lora.alpha", "a finite number > 0", self.alpha)
        check(0 <= self.dropout < 1, "lora.dropout", "in [0, 1)", self.dropout)
        targets = self.target_modules
        ok = targets == "all-linear" or (isinstance(targets, list) and targets
                                         and all(isinstance(t, str) and t for t in targets))
        check(ok, "lora.target_modules", "a non-empty list of module names, e.g. [q_proj, v_proj], or 'all-linear'",
               targets)


@dataclass
class CheckpointConfig:
    every_updates: int = field(default=0, metadata=SAFE)
    """Also checkpoint every N updates, counted over the run (after global update N, 2N, ...; 0: only at
    stage boundaries and on a stop)."""
    keep_last: int = field(default=2, metadata=SAFE)
    max_bad_updates: int = field(default=5, metadata=SAFE)
    """Stop after this many consecutive updates skipped for a non-finite loss or gradient."""

    def validate(self) -> None:
        check(self.every_updates >= 0, "checkpoint.every_updates", ">= 0", self.every_updates)
        check(self.keep_last >= 1, "checkpoint.keep_last", ">= 1", self.keep_last)
        check(self.max_bad_updates >= 1, "checkpoint.max_bad_updates", ">= 1", self.max_bad_updates)


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
            check(getattr(self, key) >= 0, f"eval.{key}", "an integer >= 0 (0 = off)", getattr(self, key))
        check(0 < self.temperature < math.inf, "eval.temperature",
               "a finite number > 0 (greedy decoding is eval.greedy)", self.temperature)
        if self.max_new_tokens is not None:
            check(self.max_new_tokens >= 1, "eval.max_new_tokens", "an integer >= 1 or null", self.max_new_tokens)
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
            check(name in LOGGERS, "log.loggers", f"a list drawn from {list(LOGGERS)}", self.loggers)


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
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    # Evaluation and logging never change what is trained: a resume may change the whole section.
    eval: EvalConfig = field(default_factory=EvalConfig, metadata=SAFE)
    log: LogConfig = field(default_factory=LogConfig, metadata=SAFE)
