"""The generation phase of a stage: read it back if persisted (resume, replay), else sync -> generate
(in rounds with dynamic sampling; turn by turn with an environment) -> score -> group advantages ->
[trainer-side behaviour log-probs] -> persist (docs/ALGORITHM.md section 3).

:class:`GenerationPhase` holds these steps as methods of :class:`mugrpo.training.trainer.Trainer`
(a mixin, as transformers' ``GenerationMixin`` is for its models): they read the trainer's engine,
task, tokenizer, state and run directory. Not here: the loop, the optimisation phase and
checkpoints (:mod:`mugrpo.training.trainer`); what a round keeps (:mod:`mugrpo.training.dynamic`,
:mod:`mugrpo.training.rounds`); one stage of environment trajectories (:mod:`mugrpo.training.env_stage`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mugrpo.algo.adaptive import stage_length
from mugrpo.algo.advantages import group_advantages, zero_variance_groups
from mugrpo.rollout.engines import SamplingConfig, weights_loaded
from mugrpo.rollout.multiturn import LoopLimits, finalize_counts
from mugrpo.rollout.rewards import per_reward_counts, per_reward_metrics
from mugrpo.rollout.tasks import limit_prompts, prompt_ids
from mugrpo.training import checkpoint as ckpt
from mugrpo.training import distributed as dist
from mugrpo.training import dynamic, rounds, seeds, tis
from mugrpo.training import replay as replay_mod
from mugrpo.training.data import SHARDS_FILE, StageData, write_stage_text
from mugrpo.training.env_stage import EnvStage, generate_env_stage
from mugrpo.training.faults import maybe_die


class GenerationPhase:
    """The generation-phase steps of :class:`~mugrpo.training.trainer.Trainer` (which provides
    ``cfg``, ``plan``, ``world``, ``policy``, ``engine``, ``task``, ``tokenizer``, ``env_factory``,
    ``run_dir``, ``state``, ``step``, ``progress`` and ``replay``)."""

    def load_or_generate_stage(self, stopper=None) -> tuple[StageData, dict]:
        """The stage's data and its generation-phase metrics: read back if persisted (resume), else
        sync -> generate -> score -> [recompute the behaviour log-probs with the trainer
        (``loss.behavior_logprobs=trainer``)] -> persist (metrics first, then the shards)."""
        stage_dir = self.run_dir.stage(self.state.stage)
        copied = self.replay is not None and self._copy_replayed_stage(stage_dir)
        data = dist.load_stage_shards(stage_dir, self.world)
        if data is not None:
            saved = self.run_dir.read_stage_metrics(stage_dir)  # {} for a stage dir from before they were kept
            replayed = {"stage/replayed": 1.0} if self.replay is not None else {}
            # saved after the stats: with dynamic sampling it holds reward/mean over every generated sequence
            return data, {"stage/resumed": 0.0 if copied else 1.0, **replayed, **stage_stats(data, self.world),
                          **saved, **tis.stage_metrics(data, self.step, self.world, stage_dir)}
        t0 = time.perf_counter()
        with weights_loaded(self.engine, dist.full_state_items(self.policy)):
            t_sync = time.perf_counter()
            if self.cfg.rollout.dynamic_sampling:
                data, record, dynamic_metrics = self._generate_rounds(stage_dir, stopper)
            else:
                drawn = self._draw(0, self.plan.prompts_per_stage)
                data, record = self._generate_scored(0, *self._prompts(drawn), len(drawn), stopper)
                dynamic_metrics = {}
        t_gen = time.perf_counter()
        data, stats = self._filter(data)
        # An environment's loop counts: summed over the rounds (if any), then over ranks.
        env = finalize_counts(dist.sum_named_over_ranks(record["env_counts"])) if "env_counts" in record else {}
        t_score = time.perf_counter()
        if self.step.loss.behavior_logprobs == "trainer":
            data = tis.recompute_trainer_logprobs(self.policy, data, self.step, dist.train_device(self.world))
            stats.update(tis.stage_metrics(data, self.step, self.world, stage_dir))
            stats["perf/recompute_s"] = time.perf_counter() - t_score
        failures = self._failure_metrics(record)
        if self.world.is_main:  # before the shards: a stage counts as generated once they are all written
            self.run_dir.write_stage_metrics(stage_dir, {**failures, **env, **dynamic_metrics,
                                                         "stage/num_groups_trained": stats["stage/num_groups_trained"]})
        dist.save_stage_shard(data, stage_dir, self.world)
        rounds.remove_rounds(stage_dir)
        if self.cfg.train.save_stage_text:
            write_stage_text(self.run_dir.stage_text(stage_dir, self.world), data, self.tokenizer, self.task.items)
        # Generation and scoring seconds: the engine's and the scorer's own (summed over rounds).
        stats.update({"perf/sync_s": t_sync - t0, "perf/generate_s": record["generate_s"],
                      "perf/score_s": record["score_s"] + t_score - t_gen,
                      "perf/generate_tok_s": record["num_new_tokens"] / max(record["generate_s"], 1e-9),
                      **failures, **env, **dynamic_metrics})
        return data, stats

    def _copy_replayed_stage(self, stage_dir: Path) -> bool:
        """Copy this stage from the replay source into the run's own stage folder, unless it is there
        already (a resumed replay; returns False): then the stage loads like any persisted stage."""
        if dist.broadcast_object((stage_dir / SHARDS_FILE).is_file() if self.world.is_main else None):
            return False
        if isinstance(self.replay, Path):  # recorded by a resumed run: check the source now
            self.replay = replay_mod.check_source(self.replay, self.cfg, self.world.size)
        if self.world.is_main:
            replay_mod.copy_stage(self.replay, self.state.stage, stage_dir,
                                  need_trainer_logprobs=self.step.loss.behavior_logprobs == "trainer",
                                  prompt_ids_of=lambda i: prompt_ids(self.tokenizer, self.task.items[i].prompt,
                                                                     self.cfg.task))
        dist.barrier()
        return True

    def _generate_scored(self, round_index: int, indices: list[int], prompts: list, num_drawn: int, stopper
                         ) -> tuple[StageData, dict]:
        """Sample G responses to each of ``prompts`` (task items ``indices``, what the length rule left of
        ``num_drawn``; the engine holds the stage's weights), score them and take the group advantages:
        the whole stage, or one round of it with dynamic sampling. Returns the data and a record (plain
        numbers, summable over rounds)."""
        state, r, G, task = self.state, self.cfg.rollout, self.cfg.rollout.group_size, self.task
        t0 = time.perf_counter()
        seed = seeds.rollout_round_sampling(self.cfg.train.seed, state.stage, self.world.rank, round_index)
        sampling = SamplingConfig(n=G, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  max_new_tokens=r.max_new_tokens, seed=seed)
        label = f"stage {state.stage} generate" + (f" (round {round_index})" if r.dynamic_sampling else "")
        bar = self.progress.bar(len(indices) * G, label, unit="seq")

        def on_batch(n: int) -> None:
            self.progress.advance(bar, n)
            maybe_die("generate")
            if stopper is not None and stopper.requested:  # the last checkpoint is this stage's start
                raise ckpt.Interrupted(self.run_dir.path)

        env_stage = None
        if self.env_factory is not None:  # multi-turn: the trajectories of G environments per item
            env_stage = self._generate_trajectories(round_index, indices, sampling, on_batch)
            indices, prompts = env_stage.indices, env_stage.prompts
        else:
            completions = self.engine.generate(prompts, sampling, progress=on_batch)
            flat = [c for group in completions for c in group]
        self.progress.close(bar)
        t_gen = time.perf_counter()
        # A trajectory is scored on its final policy turn, plus its environment reward.
        texts = env_stage.texts if env_stage else [self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                                                   for c in flat]
        rewards, score_stats = task.score_all(texts, [task.items[i] for i in indices for _ in range(G)])
        if env_stage:
            rewards = rewards + env_stage.env_rewards
        rewards = rewards.view(len(prompts), G)
        advantages, _ = group_advantages(rewards, std_scale=self.cfg.loss.adv_std_scale, eps=self.cfg.loss.adv_eps)
        if env_stage:
            data = StageData(prompts, env_stage.responses, env_stage.behavior_logprobs, rewards.flatten(),
                             advantages.flatten(), env_stage.finished, indices, G, turns=env_stage.turns)
            num_new = sum(data.num_policy_tokens(s) for s in range(len(data.responses)))
        else:
            data = StageData(prompts, [c.token_ids for c in flat], [c.behavior_logprobs for c in flat],
                             rewards.flatten(), advantages.flatten(),
                             torch.tensor([c.finish_reason == "stop" for c in flat]), indices, G)
            num_new = sum(len(c.token_ids) for c in flat)
        counts = [score_stats.num_errors, score_stats.num_timeouts, score_stats.num_invalid, score_stats.num_unparsable,
                  score_stats.num_scored, *per_reward_counts(score_stats, self._reward_names())]
        record = {"counts": [float(c) for c in counts], "num_prompts": len(prompts), "num_drawn": num_drawn,
                  "num_new_tokens": num_new, "generate_s": t_gen - t0, "score_s": time.perf_counter() - t_gen,
                  "first_error": score_stats.first_error}
        if env_stage:  # this rank's, summed over rounds and then ranks by load_or_generate_stage
            record["env_counts"] = env_stage.counts
        return data, record

    def _generate_trajectories(self, round_index: int, indices: list[int], sampling: SamplingConfig, on_batch
                               ) -> EnvStage:
        """The stage's (or the round's) multi-turn trajectories: G environments per item, turn by turn."""
        cfg = self.cfg
        limits = LoopLimits.from_config(cfg.env, cfg.rollout.max_new_tokens,
                                        max_context=getattr(self.policy.config, "max_position_embeddings", None))
        reset_seed = seeds.env_reset(cfg.train.seed, self.state.stage, self.world.rank, round_index)
        return generate_env_stage(self.engine, self.env_factory, self.task, self.tokenizer, cfg.task, indices,
                                  sampling, limits, reset_seed, progress=on_batch)

    def _generate_rounds(self, stage_dir: Path, stopper) -> tuple[StageData, dict, dict]:
        """The stage's groups generated in rounds, the informative ones kept (dynamic sampling,
        :mod:`mugrpo.training.dynamic`, :mod:`mugrpo.training.rounds`); also its record and metrics."""
        cfg, plan, state, world = self.cfg, self.plan, self.state, self.world
        planned = stage_length(plan.updates_per_stage, plan.total_updates, state.update - state.update_in_stage)
        needed = dynamic.groups_needed(plan.prompts_per_stage, plan.prompts_per_update, planned) // world.size

        def one_round(round_index: int, drawn: list[int]) -> tuple[StageData, dict]:
            return self._generate_scored(round_index, *self._prompts(drawn), len(drawn), stopper)

        def sum_over_ranks(values: list[float]) -> list[float]:
            return dist.sum_over_ranks(torch.tensor(values, dtype=torch.float64)).tolist()

        r = cfg.rollout
        data, record, found = rounds.generate_in_rounds(
            stage_dir, world.rank, world.size, needed, r.dynamic_oversample, r.dynamic_max_rounds, self._draw,
            one_round, sum_over_ranks, dist.max_over_ranks, after_round=lambda: maybe_die("round"))
        metrics = rounds.round_metrics(found, data, record, needed, world.size, sum_over_ranks)
        if found.stop == "max_rounds" and world.is_main:
            n = metrics["stage/num_informative_groups"]
            print(f"[mugrpo] warning: stage {state.stage}: dynamic sampling found "
                  + ("no informative group (nonzero reward variance)" if n == 0
                     else f"only {n} of the {needed * world.size} informative groups needed")
                  + f" in {len(found.sizes)} round(s) of {sum(found.sizes)} prompts; the stage is filled with "
                  "uninformative groups (zero advantage, no gradient) and the run goes on. Raise "
                  "rollout.dynamic_max_rounds or rollout.dynamic_oversample, or use an easier task")
        return data, record, metrics

    def _filter(self, data: StageData) -> tuple[StageData, dict]:
        """The stage's statistics; warn if no group has reward variance; drop zero-variance groups if asked."""
        zero_var = zero_variance_groups(data.rewards.view(-1, data.group_size))
        stats = stage_stats(data, self.world)
        if bool(zero_var.all()) and self.world.is_main:
            print(f"[mugrpo] warning: stage {self.state.stage}: every group has zero reward variance, so every "
                  "advantage is 0 and this stage's policy-gradient updates are zero. If this persists, the task is "
                  "too hard or too easy for the model (see stages/*/rollouts.jsonl)")
        if self.cfg.loss.drop_zero_var_groups and not bool(zero_var.all()):  # all-zero: keep them (zero gradient)
            data = data.subset([g for g in range(data.num_groups) if not zero_var[g]])
        stats["stage/num_groups_trained"] = data.num_groups
        return data, stats

    def _reward_names(self) -> list[str]:
        task = self.task
        return [r.name for r in task.rewards] if len(task.rewards) > 1 or self.cfg.task.rewards else []

    def _failure_metrics(self, record: dict) -> dict:
        """The stage's reward failures and skipped prompts (``record``: :meth:`_generate_scored`'s,
        summed over rounds), summed over ranks, with their warnings."""
        state, world, task = self.state, self.world, self.task
        if record["first_error"] and world.is_main:
            print(f"[mugrpo] warning: the reward function raised {int(record['counts'][0])} time(s) in stage "
                  f"{state.stage} (scored 0); first traceback:\n{record['first_error']}")
        names = self._reward_names()
        local = record["counts"]
        counts = dist.sum_over_ranks(torch.tensor([
            *local[:5], record["num_drawn"] - record["num_prompts"],
            *local[5:]], dtype=torch.float64)).tolist()
        num_failed = int(counts[0] + counts[1] + counts[2])
        if num_failed and num_failed == int(counts[4]) * len(task.rewards) and world.is_main:
            print(f"[mugrpo] warning: stage {state.stage}: all {num_failed} rewards failed and scored 0 "
                  f"({int(counts[0])} errors, {int(counts[1])} timeouts, {int(counts[2])} invalid values), so nothing "
                  "is learned from this stage. Check task.reward_fn / task.rewards (any traceback is printed above), "
                  "task.reward_timeout_s, and that the scorer returns a finite number")
        return {"reward/num_errors": int(counts[0]), "reward/num_timeouts": int(counts[1]),
                "reward/num_invalid": int(counts[2]), "reward/unparsable_frac": counts[3] / max(counts[4], 1),
                "stage/num_prompts_skipped": int(counts[5]), **per_reward_metrics(names, counts[6:], counts[4])}

    def _draw(self, offset: int, count: int) -> list[int]:
        """This rank's share (whole groups) of items ``offset .. offset + count`` of the stage's prompt
        draw: one seeded sequence, of which dynamic sampling's rounds take consecutive slices."""
        seed = seeds.prompt_draw(self.cfg.train.seed, self.state.stage)
        return dist.generation_share(
            dynamic.draw_slice(lambda n: self.task.sample(n, torch.Generator().manual_seed(seed)), offset, count),
            self.world)

    def _prompts(self, indices: list[int]) -> tuple[list[int], list]:
        """What :meth:`_generate_scored` takes for these items: their tokenised prompts (:meth:`_tokenise`),
        or none with an environment, which renders (and length-checks) its own."""
        return self._tokenise(indices) if self.env_factory is None else (indices, [])

    def _tokenise(self, indices: list[int]) -> tuple[list[int], list]:
        """The items' prompts, tokenised, the length rule applied: (the indices kept, their prompts)."""
        prompts = [prompt_ids(self.tokenizer, self.task.items[i].prompt, self.cfg.task) for i in indices]
        prompts, kept = limit_prompts(prompts, self.cfg.task, "training")
        return [indices[i] for i in kept], prompts


def stage_stats(data: StageData, world) -> dict:
    lengths = torch.tensor([len(r) for r in data.responses], dtype=torch.float32)
    rewards = dist.gather_cat(data.rewards)
    multi = {} if data.turns is None else {"stage/policy_len_mean": dist.mean_over_ranks(
        sum(data.num_policy_tokens(s) for s in range(len(data.responses))), lengths.numel())}
    return {**multi,
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
        "stage/response_len_mean": dist.mean_over_ranks(lengths.sum(), lengths.numel()),
        "stage/truncated_frac": dist.mean_over_ranks((~data.finished).float().sum(), lengths.numel()),
        "stage/num_sequences": int(rewards.numel()),
        "stage/num_groups": int(rewards.numel()) // data.group_size,
        "stage/zero_var_group_frac": float(zero_variance_groups(rewards.view(-1, data.group_size)).float().mean()),
    }
