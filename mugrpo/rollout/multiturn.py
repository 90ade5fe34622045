"""The multi-turn rollout loop: a stage's trajectories, turn by turn, with token-exact bookkeeping.

A trajectory is the prompt, then policy turns (sampled by the engine) alternating with
environment turns (the messages ``env.step`` returns, tokenized once by the caller's renderer and
appended). Lock-step (here; ``env.lockstep``, and always on an in-process engine): every turn, all
active trajectories go to the engine in ONE ``generate`` call: the first turn with n = G per prompt
(each prompt prefilled once), later turns with each trajectory's ids so far as its own prompt (n = 1;
vLLM's prefix cache reuses their KV). Then the environment steps of the trajectories that finished
their policy turn run concurrently (:mod:`mugrpo.rollout.calls`). On an engine that serves concurrent
calls each trajectory advances on its own instead (:mod:`mugrpo.rollout.trajectories`), through the
same per-trajectory steps defined here (:func:`take_policy_turn`, :func:`settle_step`).

Token exactness (TRL's ``_tool_call_loop`` rule): the engine's sampled ids and behaviour log-probs
are appended exactly as returned; an environment turn is appended as the renderer's ids with
log-prob 0; nothing is ever decoded and re-encoded. ``turns[t]`` is k >= 0 for a token of policy
turn k and -1 for an environment token (docs/MULTITURN.md, the stage-data layout).

A trajectory ends (``end_reason``), each counted by :func:`loop_metrics`:

- ``done``          the environment said done
- ``turn_limit``    its last allowed policy turn was stepped and the environment still was not done
- ``length``        a policy turn hit the token budget (truncated, as single-turn "length")
- ``overflow``      the next environment turn would overflow the budget or the model context: it is
                    NOT appended (TRL's rule) and the trajectory is truncated
- ``env_error`` / ``env_timeout`` / ``env_bad_output``  ``env.step`` (or rendering its messages)
                    raised, ran past ``step_timeout_s``, or returned something that is not a
                    :class:`StepResult` of text messages, a reward finite as a float32 and a bool
                    ``done``. Never a crash.

Values are checked before they are used: numbers in step metadata and ``env.metrics()`` that are
not finite as a float32 are dropped (``num_dropped_values``); an observation longer than
``max_observation_chars`` is cut before it is rendered (``num_truncated_observations``); a policy
turn takes at most ``max_tokens_per_turn`` tokens. :func:`first_problems` gives the first failure
of each kind, for the stage's warnings.

The token budget covers every response token, policy and environment (``rollout.max_new_tokens``
applies to the whole trajectory, TRL's ``max_completion_length`` semantics).

This module knows nothing about rewards beyond the environment's, advantages or the loss.
:func:`roll_out_items` is the whole generation of a stage from a factory (start, loop, close);
:func:`run_trajectories` the loop on environments already reset. Both take a :class:`LoopContext`:
the engine, the tokenizer, the loop's limits and how environment turns are rendered, the same for
every call of a stage (training's generation and evaluation each build one).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from mugrpo.faults import maybe_die
from mugrpo.rollout.calls import CallResult, run_calls
from mugrpo.rollout.engines.base import Completion, SamplingConfig
from mugrpo.rollout.envs.base import EnvFactory, Environment, StepResult
from mugrpo.seeds import derive

if TYPE_CHECKING:
    from mugrpo.rollout.envs.start import Skips

END_REASONS = ("done", "turn_limit", "length", "overflow", "env_error", "env_timeout", "env_bad_output")
TRUNCATED = ("length", "overflow")
FLOAT32_MAX = 3.4028234663852886e38
"""Rewards are stored as float32: a larger one would become inf."""
ENV_TOKEN = -1
"""The ``turns`` value of an environment token."""
MAX_TURNS = 127
"""``turns`` is stored as int8."""

EnvTurnRenderer = Callable[[list[dict], bool], list[int]]
"""(messages to append, did the policy turn end on EOS) -> the token ids of that environment turn,
computed once (:mod:`mugrpo.rollout.envs.render`)."""


@dataclass(frozen=True)
class LoopLimits:
    max_turns: int = 4
    """Policy turns at most; the environment's own ``max_turns`` applies too (the smaller wins)."""
    max_response_tokens: int = 256
    """Policy + environment tokens after the prompt (``rollout.max_new_tokens``)."""
    max_context: Optional[int] = None
    """Prompt + response tokens at most (the model's context); None = no limit beyond the budget."""
    step_timeout_s: float = 30.0
    max_workers: int = 8
    """Environment steps running at once."""
    reset_timeout_s: float = 60.0
    """Making one environment, its ``reset`` and its ``tools()``, each at most this long."""
    max_observation_chars: int = 20000
    """An environment message longer than this is cut to it before it is rendered (counted)."""
    max_tokens_per_turn: Optional[int] = None
    """New tokens of one policy turn at most; None = the sampling's ``max_new_tokens``."""
    lockstep: bool = False
    """Turn by turn even on an engine that serves concurrent calls (``env.lockstep``)."""
    max_inflight: int = 64
    """Independent trajectories: generation requests in flight at once, at most (``env.max_inflight``)."""

    @classmethod
    def from_config(cls, env_cfg, max_response_tokens: int, max_context: Optional[int] = None) -> "LoopLimits":
        """The limits a run's ``env`` config section sets (``env.max_turns``, ``env.step_timeout_s``,
        ``env.max_workers``, ``env.reset_timeout_s``, ``env.max_observation_chars``,
        ``env.max_tokens_per_turn``, ``env.lockstep``, ``env.max_inflight``), with the trajectory's token
        budget and the model's context."""
        return cls(max_turns=env_cfg.max_turns, max_response_tokens=max_response_tokens, max_context=max_context,
                   step_timeout_s=env_cfg.step_timeout_s, max_workers=env_cfg.max_workers,
                   reset_timeout_s=env_cfg.reset_timeout_s, max_observation_chars=env_cfg.max_observation_chars,
                   max_tokens_per_turn=env_cfg.max_tokens_per_turn, lockstep=env_cfg.lockstep,
                   max_inflight=env_cfg.max_inflight)

    def __post_init__(self):
        if not 1 <= self.max_turns <= MAX_TURNS:
            raise ValueError(f"max_turns must be in 1..{MAX_TURNS} (turns are stored as int8), got {self.max_turns}")
        if (self.max_response_tokens < 1 or self.step_timeout_s <= 0 or self.max_workers < 1
                or self.reset_timeout_s <= 0 or self.max_observation_chars < 1
                or (self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1)
                or self.max_inflight < 1):
            raise ValueError(f"invalid loop limits {self}: need max_response_tokens >= 1, step_timeout_s > 0, "
                             "max_workers >= 1, reset_timeout_s > 0, max_observation_chars >= 1, "
                             "max_tokens_per_turn None or >= 1, max_inflight >= 1")


@dataclass
class Trajectory:
    prompt_ids: list[int]
    env: Environment
    max_turns: int
    response_ids: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    """One per response token; 0.0 on environment tokens."""
    turns: list[int] = field(default_factory=list)
    """One per response token: policy turn k >= 0, or -1 (:data:`ENV_TOKEN`)."""
    num_turns: int = 0
    """Policy turns taken."""
    end_reason: Optional[str] = None
    env_reward: float = 0.0
    metadata: dict[str, float] = field(default_factory=dict)
    """Numeric ``StepResult.metadata`` summed over steps, plus ``env.metrics()`` at the end."""
    last_turn_ids: list[int] = field(default_factory=list)
    final_text: str = ""
    """The decoded final policy turn (what the task's rewards score)."""
    error: Optional[str] = None
    """The first failure's traceback or description, for the run's warning."""
    problems: dict[str, str] = field(default_factory=dict)
    """The first failure of each kind (an end reason, ``close_error``, ``dropped_value``): its
    traceback or description, for the stage's warnings (:func:`first_problems`)."""

    @property
    def active(self) -> bool:
        return self.end_reason is None

    @property
    def truncated(self) -> bool:
        return self.end_reason in TRUNCATED

    def append(self, ids: list[int], logprobs: list[float], turn: int) -> None:
        self.response_ids += ids
        self.behavior_logprobs += logprobs
        self.turns += [turn] * len(ids)

    def room(self, limits: LoopLimits) -> int:
        """Tokens that may still be appended."""
        room = limits.max_response_tokens - len(self.response_ids)
        if limits.max_context is not None:
            room = min(room, limits.max_context - len(self.prompt_ids) - len(self.response_ids))
        return room


@dataclass(frozen=True)
class LoopContext:
    """What the multi-turn chain needs besides the items and the sampling: one per stage (or evaluation).

    ``task_cfg`` is the prompt format (:func:`mugrpo.rollout.tasks.render_messages`) for an
    environment whose ``reset`` gives no messages. The three renderers default to the tokenizer's:
    environment turns by :func:`mugrpo.rollout.envs.render.env_turn_ids`, a policy turn's text by
    ``tokenizer.decode(ids, skip_special_tokens=True)``, and the EOS ids by the engine's ``eos``
    (else the tokenizer's EOS); a test may pass its own."""

    engine: Any
    tokenizer: Any
    limits: LoopLimits
    task_cfg: Any = None
    render_env_turn: Optional[EnvTurnRenderer] = None
    decode: Optional[Callable[[list[int]], str]] = None
    eos: Optional[tuple[int, ...]] = None

    def env_turn_ids(self, messages: list[dict], ended_on_eos: bool) -> list[int]:
        if self.render_env_turn is not None:
            return self.render_env_turn(messages, ended_on_eos)
        from mugrpo.rollout.envs.render import env_turn_ids

        return env_turn_ids(self.tokenizer, messages, ended_on_eos)

    def text(self, ids: list[int]) -> str:
        return self.decode(ids) if self.decode is not None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def eos_ids(self) -> list[int]:
        if self.eos is not None:
            return list(self.eos)
        return list(getattr(self.engine, "eos", [self.tokenizer.eos_token_id]))

    @property
    def independent(self) -> bool:
        """Do trajectories advance on their own? Only on an engine that serves concurrent calls
        (``engine.concurrent``: the remote engine; an in-process engine serves one call at a time and has
        no such attribute) and without ``limits.lockstep``."""
        return getattr(self.engine, "concurrent", False) is True and not self.limits.lockstep


def roll_out_items(ctx: LoopContext, factory: EnvFactory, items: list, sampling: SamplingConfig, *,
                   reset_seed: int, select: Optional[Callable[[list[list[int]]], list[int]]] = None,
                   progress: Optional[Callable[[int], None]] = None, skipped: Optional[Skips] = None
                   ) -> tuple[list[int], list[list[int]], list[Trajectory]]:
    """A stage's trajectories for ``items``: (the groups kept, their prompts, G = ``sampling.n``
    trajectories per kept group, group-major).

    Environments are made and reset (:func:`mugrpo.rollout.envs.start.start_trajectories`, each call
    bounded by ``limits.reset_timeout_s``). With ``skipped`` (a :class:`mugrpo.rollout.envs.start.Skips`),
    an item whose environment cannot be made or reset is left out and what failed is appended to
    ``skipped.failures`` (every item failing stops, unless ``skipped.none_left_stops`` is False: then
    nothing is rolled out, ``([], [], [])``); without it, the first such failure stops. ``select(prompts)`` may keep only some groups
    (e.g. the prompt-length rule; the others' envs are closed); the rest are rolled out and closed
    (also when the loop raises). A turn ends at the engine's EOS.
    """
    from mugrpo.rollout.envs.start import start_trajectories

    G, limits = sampling.n, ctx.limits
    started = start_trajectories(factory, items, G, reset_seed, ctx.tokenizer, ctx.task_cfg,
                                 limits.reset_timeout_s, skipped)
    if not started.kept:
        return [], [], []
    prompts, envs = started.prompts, started.envs
    try:
        kept = list(range(len(prompts))) if select is None else list(select(prompts))
        dropped = sorted(set(range(len(prompts))) - set(kept))
        _close_all([Trajectory([], envs[g * G + j], 1) for g in dropped for j in range(G)], limits)
        envs = [envs[g * G + j] for g in kept for j in range(G)]
        prompts = [prompts[g] for g in kept]
        trajs = run_trajectories(ctx, prompts, envs, sampling, progress=progress)
    except BaseException:
        _close_all([Trajectory([], env, 1) for env in envs], limits)
        raise
    return [started.kept[g] for g in kept], prompts, trajs


def run_trajectories(ctx: LoopContext, prompts: list[list[int]], envs: list[Environment], sampling: SamplingConfig,
                     progress: Optional[Callable[[int], None]] = None) -> list[Trajectory]:
    """Roll out ``len(envs) // len(prompts)`` = G trajectories per prompt (``envs`` group-major, reset).

    ``sampling.n`` is ignored (G comes from ``envs``); ``sampling.max_new_tokens`` caps one policy
    turn; the stop strings are the environments' (all must share them). Independent trajectories
    (:mod:`mugrpo.rollout.trajectories`) when ``ctx.independent``, else lock-step. ``progress(n)`` is
    called with the trajectories just ended, and with 0 as a heartbeat; an exception raised from it stops
    the loop (requests in flight are stopped, steps in flight waited for) and propagates.
    """
    limits = ctx.limits
    G = len(envs) // max(len(prompts), 1)
    if not prompts or G * len(prompts) != len(envs):
        raise ValueError(f"{len(envs)} environments for {len(prompts)} prompts: need G per prompt, G >= 1")
    trajs = [Trajectory(prompts[i // G], env, min(limits.max_turns, env.max_turns)) for i, env in enumerate(envs)]
    for t in trajs:
        if t.room(limits) < 1:
            raise ValueError(f"a prompt of {len(t.prompt_ids)} tokens leaves no room in the model context "
                             f"({limits.max_context} tokens); lower task.max_prompt_tokens")
        if t.max_turns < 1:
            raise ValueError(f"environment {type(t.env).__name__} has max_turns={t.env.max_turns}; need >= 1")
    sampling = dataclasses.replace(sampling, stop=_shared_stop(envs))
    t0 = time.perf_counter()
    if ctx.independent:
        from mugrpo.rollout.trajectories import run_independent

        busy_s = run_independent(ctx, trajs, G, sampling, progress)
    else:
        busy_s = _run_lockstep(ctx, trajs, G, sampling, progress)
    share_out(trajs, "engine_busy_s", busy_s)
    share_out(trajs, "loop_s", time.perf_counter() - t0)
    _close_all(trajs, limits)
    return trajs


def _run_lockstep(ctx: LoopContext, trajs: list[Trajectory], G: int, sampling: SamplingConfig,
                  progress: Optional[Callable[[int], None]]) -> float:
    """Turn by turn: every active trajectory's turn in one engine call, then every environment step. Returns
    the seconds the engine worked (inside ``generate``)."""
    eos, turn, busy_s = ctx.eos_ids(), 0, 0.0
    # Inside a turn the engine's own calls are heartbeats only (progress(0)): the caller may stop there.
    beat = None if progress is None else (lambda n: progress(0))
    while any(t.active for t in trajs):
        active = [t for t in trajs if t.active]
        t_gen = time.perf_counter()
        completions = _policy_turn(ctx.engine, active, sampling, ctx.limits, turn, G if turn == 0 else 1, beat)
        busy_s += time.perf_counter() - t_gen
        stepping = [t for t, c in zip(active, completions) if take_policy_turn(t, c, turn, ctx.text)]
        maybe_die("turn")
        _environment_turn(stepping, ctx.limits, ctx.env_turn_ids, eos)
        if progress is not None:
            progress(sum(1 for t in active if not t.active))
        turn += 1
    return busy_s


def share_out(trajs: list[Trajectory], key: str, seconds: float) -> None:
    """Add ``seconds`` of the loop's wall clock to ``metadata[key]``, shared out evenly over ``trajs``: the
    trajectories' sum (what :func:`loop_counts` reports) is the loop's figure."""
    for t in trajs:
        t.metadata[key] = t.metadata.get(key, 0.0) + seconds / max(len(trajs), 1)


def _shared_stop(envs: list[Environment]) -> tuple[str, ...]:
    stops = {tuple(env.stop) for env in envs}
    if len(stops) > 1:
        raise ValueError(f"the environments of one stage must share their stop strings; got {sorted(stops)}")
    return stops.pop()


def turn_cap(t: Trajectory, sampling: SamplingConfig, limits: LoopLimits) -> int:
    """New tokens ``t``'s next policy turn may take: the turn's limit, within the trajectory's room."""
    per_turn = sampling.max_new_tokens if limits.max_tokens_per_turn is None else min(
        sampling.max_new_tokens, limits.max_tokens_per_turn)
    return min(per_turn, t.room(limits))


def _policy_turn(engine, active: list[Trajectory], sampling: SamplingConfig, limits: LoopLimits, turn: int,
                 n: int, beat=None) -> list[Completion]:
    """One engine call for every active trajectory; turn 0 samples n = G per prompt. ``beat``: the
    engine's progress callback (called with 0 only)."""
    seed = derive(sampling.seed, "multiturn-turn", turn)
    per_turn = dataclasses.replace(sampling, n=n, seed=seed)
    heads = active[::n]  # turn 0: the first trajectory of each group; later: all (n = 1)
    caps = [turn_cap(t, sampling, limits) for t in heads]
    prompts = [t.prompt_ids + t.response_ids for t in heads]
    out = engine.generate(prompts, per_turn, progress=beat, max_new_tokens=caps)
    return [c for group in out for c in group]


def take_policy_turn(t: Trajectory, c: Completion, turn: int, decode) -> bool:
    """Append the sampled turn exactly; True when the trajectory goes on to an environment step."""
    t.append(list(c.token_ids), list(c.behavior_logprobs), turn)
    t.num_turns += 1
    t.last_turn_ids = list(c.token_ids)
    t.final_text = decode(t.last_turn_ids)
    if c.finish_reason == "length":
        t.end_reason = "length"
        return False
    return True


def step_call(t: Trajectory) -> Callable[[], Any]:
    """The call that steps ``t``'s environment on its last policy turn (for a :class:`CallRunner`)."""
    def call():
        maybe_die("env_step")  # a kill point inside a tool call, for the resume tests
        return t.env.step(t.final_text)
    return call


def _environment_turn(stepping: list[Trajectory], limits: LoopLimits, render: EnvTurnRenderer, eos: list[int]) -> None:
    """Step every environment concurrently, then append each environment turn or end the trajectory."""
    t0 = time.perf_counter()
    results = run_calls([step_call(t) for t in stepping], limits.max_workers, limits.step_timeout_s)
    waited = (time.perf_counter() - t0) / max(len(stepping), 1)
    for t in stepping:  # the turn's wall-clock wait, shared out: the trajectories' sum is the loop's wait
        t.metadata["step_wait_s"] = t.metadata.get("step_wait_s", 0.0) + waited
    for t, r in zip(stepping, results):
        settle_step(t, r, limits, render, eos)


def settle_step(t: Trajectory, r: CallResult, limits: LoopLimits, render: EnvTurnRenderer, eos: list[int]) -> None:
    """Take one environment step's outcome: append its environment turn, or end the trajectory (done, a
    limit, or the step's failure)."""
    if r.timed_out:
        _end(t, "env_timeout", f"env.step ran past {limits.step_timeout_s:g} s")
    elif r.error is not None:
        _end(t, "env_error", r.error)
    elif (problem := _invalid_step(r.value)) is not None:
        _end(t, "env_bad_output", problem)
    else:
        _apply_step(t, r.value, limits, render, ended_on_eos=bool(t.last_turn_ids) and t.last_turn_ids[-1] in eos)


def _apply_step(t: Trajectory, result: StepResult, limits: LoopLimits, render: EnvTurnRenderer,
                ended_on_eos: bool) -> None:
    t.env_reward += float(result.reward)
    _add_numbers(t, result.metadata)
    if result.done:
        t.end_reason = "done"
        return
    if t.num_turns >= t.max_turns:
        t.end_reason = "turn_limit"
        return
    try:
        ids = list(render(_capped(t, result.observations, limits.max_observation_chars), ended_on_eos))
    except Exception as exc:  # noqa: BLE001 - messages the template cannot render are the env's bad output
        _end(t, "env_bad_output", f"rendering the environment's messages failed: {exc!r}")
        return
    if len(ids) >= t.room(limits):  # at least one policy token must fit after it
        t.end_reason = "overflow"
        return
    t.append(ids, [0.0] * len(ids), ENV_TOKEN)


def _capped(t: Trajectory, messages: list[dict], max_chars: int) -> list[dict]:
    """``messages`` with each content longer than ``max_chars`` cut to it (counted), never tokenized whole."""
    out = []
    for m in messages:
        if len(m["content"]) > max_chars:
            m = {**m, "content": m["content"][:max_chars]}
            t.metadata["num_truncated_observations"] = t.metadata.get("num_truncated_observations", 0.0) + 1
        out.append(m)
    return out


def _finite(value) -> Optional[float]:
    """``value`` as a float that stays finite in float32 (rewards and metrics are stored so), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return number if math.isfinite(number) and abs(number) <= FLOAT32_MAX else None


def _add_numbers(t: Trajectory, values: dict) -> None:
    """Sum the numbers of ``values`` into ``t.metadata``; a number that is not a finite float (NaN,
    inf, 1e300, an int too large for a float) is dropped and counted in ``num_dropped_values``; other
    values (text, lists) are not numbers to log and are ignored, as ever."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        number = _finite(value)
        if number is None:
            t.metadata["num_dropped_values"] = t.metadata.get("num_dropped_values", 0.0) + 1
            t.problems.setdefault("dropped_value", f"dropped {key}={value!r:.60} of the environment's metadata or "
                                  "metrics: not a number that is finite as a float32")
            continue
        t.metadata[key] = t.metadata.get(key, 0.0) + number


def _invalid_step(value) -> Optional[str]:
    """Why ``value`` is not a usable step result, or None."""
    if not isinstance(value, StepResult):
        return f"env.step returned {type(value).__name__}, not a StepResult"
    if _finite(value.reward) is None:
        return (f"env.step returned reward {value.reward!r:.60}, not a number that is finite as a float32 "
                f"(|reward| <= {FLOAT32_MAX:.3g})")
    if not isinstance(value.done, bool):
        return f"env.step returned done={value.done!r:.60}, not a bool"
    if not isinstance(value.observations, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value.observations):
        return "env.step returned observations that are not a list of {'role': str, 'content': str} messages"
    if not isinstance(value.metadata, dict):
        return f"env.step returned metadata of type {type(value.metadata).__name__}, not a dict"
    return None


def _end(t: Trajectory, reason: str, error: str) -> None:
    t.end_reason = reason
    t.error = t.error or error
    t.problems.setdefault(reason, error)


def first_problems(trajs: list[Trajectory]) -> dict[str, str]:
    """The first traceback or description of each kind of failure among ``trajs`` (in order)."""
    out: dict[str, str] = {}
    for t in trajs:
        for kind, text in t.problems.items():
            out.setdefault(kind, text)
    return out


def _close_all(trajs: list[Trajectory], limits: LoopLimits) -> None:
    """``env.metrics()`` then ``env.close()`` for every trajectory, concurrently; failures counted."""
    def finish(t: Trajectory):
        def call():
            try:
                return dict(t.env.metrics())
            finally:
                t.env.close()
        return call

    results = run_calls([finish(t) for t in trajs], limits.max_workers, limits.step_timeout_s)
    for t, r in zip(trajs, results):
        if not r.ok or not isinstance(r.value, dict):
            t.metadata["num_close_errors"] = t.metadata.get("num_close_errors", 0.0) + 1
            t.problems.setdefault("close_error", f"env.metrics()/close() ran past {limits.step_timeout_s:g} s"
                                  if r.timed_out else r.error or
                                  f"env.metrics() returned {type(r.value).__name__}, not a dict")
            continue
        _add_numbers(t, r.value)


def loop_counts(trajs: list[Trajectory]) -> dict[str, float]:
    """Stage-level SUMS (summable over ranks): how trajectories ended, turns, the token split, the
    environment reward, and env/<key> for every number in step metadata and ``env.metrics()``."""
    counts = {f"env/num_{reason}": float(sum(t.end_reason == reason for t in trajs)) for reason in END_REASONS}
    num_policy = sum(sum(1 for k in t.turns if k >= 0) for t in trajs)
    counts.update({
        "env/num_trajectories": float(len(trajs)),
        "env/num_turns": float(sum(t.num_turns for t in trajs)),
        "env/reward_sum": float(sum(t.env_reward for t in trajs)),
        "env/num_policy_tokens": float(num_policy),
        "env/num_env_tokens": float(sum(len(t.turns) for t in trajs) - num_policy),
    })
    keys = sorted({k for t in trajs for k in t.metadata} | (set(LOOP_KEYS) if trajs else set()))
    if trajs and any(_is_tool_env(t.env) for t in trajs):  # tool counts present as 0 when no step was reached
        from mugrpo.rollout.envs.tools import COUNT_KEYS

        keys = sorted(set(keys) | set(COUNT_KEYS) | {"step_wait_s"})
    counts.update({f"env/{k}": sum(t.metadata.get(k, 0.0) for t in trajs) for k in keys})
    if "tool_calls" in keys:  # a tool environment: how many trajectories called a tool at all
        counts["env/num_with_tool_call"] = float(sum(t.metadata.get("tool_calls", 0.0) > 0 for t in trajs))
    return counts


def _is_tool_env(env) -> bool:
    from mugrpo.rollout.envs.tools import ToolEnvironment

    return isinstance(env, ToolEnvironment)


LOOP_KEYS = ("engine_busy_s", "loop_s", "num_overlapped_steps")
"""The loop's own measurements, kept in every trajectory's ``metadata`` beside the environment's numbers
(shared out: their sums are the loop's), and reported under ``perf/`` by :func:`finalize_counts`."""


def finalize_counts(counts: dict[str, float]) -> dict[str, float]:
    """The logged metrics from (rank-summed) :func:`loop_counts`: sums become means where a mean is meant.

    With tools: ``env/tool_call_frac`` (trajectories that made at least one call / all) and
    ``env/tool_success_frac`` (calls answered without an error / calls; NaN without a call); the
    counts per tool are ``env/tool_calls/<name>`` and ``env/tool_errors/<name>``; ``perf/tool_wait_s``:
    the wall-clock seconds the rollout loop waited for the tool environments' steps (their tool calls),
    summed over rounds and ranks (``perf/env_wait_s`` for an environment without tools): the seconds in
    which an environment step ran while no generation request was in flight (lock-step: every environment
    turn). ``perf/engine_busy_frac``: the fraction of the loop's wall-clock time with at least one generation
    request in flight (over rounds and ranks: their busy seconds over their loop seconds);
    ``perf/num_overlapped_steps``: environment steps during which a generation request was in flight (0 in
    lock-step: tools and generation overlapped that often)."""
    out = dict(counts)
    n = max(out.pop("env/num_trajectories"), 1.0)
    out["env/turns_mean"] = out.pop("env/num_turns") / n
    out["env/reward_mean"] = out.pop("env/reward_sum") / n
    if "env/num_with_tool_call" in out:  # will RL see tool use at all, and does it work when tried?
        out["env/tool_call_frac"] = out["env/num_with_tool_call"] / n
        calls = out.get("env/tool_calls", 0.0)
        out["env/tool_success_frac"] = 1.0 - out.get("env/tool_errors", 0.0) / calls if calls else math.nan
    busy, loop = out.pop("env/engine_busy_s", None), out.pop("env/loop_s", None)
    if loop:
        out["perf/engine_busy_frac"] = busy / loop
    if "env/num_overlapped_steps" in out:
        out["perf/num_overlapped_steps"] = out.pop("env/num_overlapped_steps")
    wait = out.pop("env/step_wait_s", None)  # a duration, not a count: under perf/, beside the stage's timings
    if wait is not None:
        out["perf/tool_wait_s" if "env/num_with_tool_call" in out else "perf/env_wait_s"] = wait
    return out


def loop_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """:func:`finalize_counts` of one process's trajectories."""
    return finalize_counts(loop_counts(trajs))
