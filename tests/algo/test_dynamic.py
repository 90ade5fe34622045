"""Dynamic sampling: which groups are informative, the round arithmetic, which
prompts each round draws, which groups are kept and in what order, the round files, and the plan,
all on hand-built cases with the arithmetic in the comments."""

import pytest
import torch

from mugrpo import seeds
from mugrpo.stages.data import StageData, StageDataError
from mugrpo.algo.dynamic import (Rounds, draw_slice, first_round_size, groups_needed, informative_groups,
                                     next_round_size, plan_rows, round_decision, run_rounds, select_groups)
from mugrpo.stages.rounds import assemble, load_round, remove_rounds, round_paths, save_round, sum_records

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------------------------------------
# Informative groups.


def test_informative_groups_keep_exactly_the_groups_with_reward_variance():
    # verl's DAPO test case: p1 all right, p2 one right, p3 all wrong, p4 three right.
    rewards = torch.tensor([[1.0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]])
    assert informative_groups(rewards).tolist() == [False, True, False, True]
    # Weighted partial credit: equal non-binary rewards are as uninformative as all-zero ones;
    # a difference of 0.25 is informative.
    weighted = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.25, 0.5], [-1.0, -1.0, -1.0]])
    assert informative_groups(weighted).tolist() == [False, True, False]


def test_group_size_one_is_never_informative():
    # One reward has no variance; group_advantages gives it A = 0, so it carries no gradient.
    assert informative_groups(torch.tensor([[1.0], [0.0], [0.3]])).tolist() == [False, False, False]


def test_informative_is_exactly_nonzero_advantage():
    from mugrpo.algo.advantages import group_advantages

    rewards = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1], [2, 2, 2, 2]])
    advantages, _ = group_advantages(rewards)
    assert informative_groups(rewards).tolist() == (advantages != 0).any(dim=1).tolist() == [True, False, True, False]


# ---------------------------------------------------------------------------------------------
# Round arithmetic.


@pytest.mark.parametrize("per_stage,per_update,updates,expected", [
    (32, 8, 4, 32),  # the default: prompts_per_stage = mu x prompts_per_update
    (16, 8, 4, 16),  # the user chose two passes over 16 groups: kept
    (64, 8, 4, 32),  # half a pass: the updates never draw more than 8 x 4 = 32
    (32, 8, 2, 16),  # the budget ends the stage after 2 updates: 8 x 2
])
def test_groups_needed(per_stage, per_update, updates, expected):
    assert groups_needed(per_stage, per_update, updates) == expected


@pytest.mark.parametrize("needed,oversample,world,expected", [
    (32, 1.5, 1, 48),   # 32 x 1.5 = 48
    (32, 1.5, 5, 50),   # 48 rounded up to a multiple of 5 ranks
    (32, 1.0, 1, 32),   # no over-generation: today's draw
    (10, 1.1, 1, 11),   # 10 x 1.1 = 11.000000000000002 in floating point: still 11
    (3, 1.1, 1, 4),     # ceil(3.3) = 4
    (32, 3.0, 4, 96),
])
def test_first_round_size(needed, oversample, world, expected):
    assert first_round_size(needed, oversample, world) == expected


@pytest.mark.parametrize("short,generated,informative,cap,world,expected", [
    (10, 48, 12, 48, 1, 40),   # p = 12/48 = 1/4: 10 / (1/4) = 40
    (9, 48, 12, 48, 1, 36),    # 9 x 4
    (9, 48, 12, 48, 8, 40),    # 36 rounded up to a multiple of 8 ranks
    (10, 48, 3, 48, 1, 48),    # p = 1/16: 160 wanted, capped at round 0's 48
    (10, 48, 0, 48, 1, 48),    # nothing informative yet: round 0's size again
    (1, 64, 63, 64, 1, 2),     # 1 x 64 / 63 = 1.016: 2
    (0, 48, 12, 48, 1, 0),     # nothing missing
])
def test_next_round_size(short, generated, informative, cap, world, expected):
    assert next_round_size(short, generated, informative, cap, world) == expected


def test_round_decision():
    assert round_decision(0, 1, 4) == "enough"
    assert round_decision(-3, 4, 4) == "enough"  # a surplus is enough, even on the last round
    assert round_decision(5, 4, 4) == "max_rounds"
    assert round_decision(5, 3, 4) is None
    assert round_decision(5, 1, 1) == "max_rounds"


# ---------------------------------------------------------------------------------------------
# Which prompts, which groups.


def _task_sample(pool: int, seed: int):
    """Task.sample's draw with a fresh generator per call, as the trainer makes it."""
    from mugrpo.rollout.tasks import Task

    task = Task("t", [None] * pool, [], [], 1.0)
    return lambda count: task.sample(count, torch.Generator().manual_seed(seed))


def test_rounds_draw_consecutive_slices_of_one_draw():
    sample = _task_sample(pool=10, seed=3)
    r0, r1, r2 = draw_slice(sample, 0, 4), draw_slice(sample, 4, 4), draw_slice(sample, 8, 5)
    # Round 0 is the draw a stage without dynamic sampling makes.
    assert r0 == sample(4)
    # No prompt repeats while the pool of 10 has more: rounds 0-1 and the first 2 of round 2 are 10
    # distinct items; the 11th-13th items start the next permutation.
    assert sorted(r0 + r1 + r2[:2]) == list(range(10))
    assert r0 + r1 + r2 == sample(13)
    # A resumed run (fresh generator) draws the same round 2.
    assert draw_slice(_task_sample(pool=10, seed=3), 8, 5) == r2


def test_select_groups_keeps_the_first_informative_in_draw_order():
    flags = [False, True, False, True, True]
    assert select_groups(flags, 2) == [1, 3]              # the first two informative
    assert select_groups(flags, 3) == [1, 3, 4]
    assert select_groups(flags, 4) == [0, 1, 3, 4]        # short by one: the earliest uninformative fills
    assert select_groups([False] * 4, 2) == [0, 1]        # nothing informative: today's first groups
    assert select_groups(flags, 0) == []


# ---------------------------------------------------------------------------------------------
# The round loop, with scripted rounds.


def _scripted(rounds_flags):
    calls = []

    def generate(round_index, offset, size):
        calls.append((round_index, offset, size))
        return rounds_flags[round_index]
    return generate, calls


def test_rounds_until_enough():
    # 4 needed, oversample 2: round 0 draws 8 and finds 2 informative, so 2 are missing at p = 2/8:
    # round 1 draws 2 / (2/8) = 8 (= the cap) and finds 3 more: 5 >= 4, stop.
    generate, calls = _scripted([[True, False, False, True, False, False, False, False],
                                 [False, False, True, False, True, True, False, False]])
    rounds = run_rounds(4, 2.0, 4, 1, generate)
    assert calls == [(0, 0, 8), (1, 8, 8)]
    assert rounds.sizes == [8, 8] and rounds.stop == "enough"
    # Informative at positions 0, 3, 8 + 2 = 10, 12, 13; the first 4 are kept, in draw order.
    assert select_groups(rounds.flat, 4) == [0, 3, 10, 12]


def test_rounds_sized_from_the_observed_fraction():
    # 8 needed, oversample 1: round 0 draws 8, finds 4 (p = 1/2), 4 missing: round 1 draws 4 / (1/2) = 8;
    # finds 1 (5 of 16, p = 5/16), 3 missing: round 2 draws ceil(3 x 16 / 5) = ceil(9.6) = 10, capped at 8.
    generate, calls = _scripted([[True, False] * 4, [True] + [False] * 7, [True] * 8])
    rounds = run_rounds(8, 1.0, 5, 1, generate)
    assert [c[2] for c in calls] == [8, 8, 8] and [c[1] for c in calls] == [0, 8, 16]
    assert rounds.stop == "enough"


def test_rounds_run_out_and_fill():
    # Nothing informative anywhere: every round draws round 0's size, 3 rounds, then the stage is
    # filled with the first 4 groups drawn (a stage as without dynamic sampling: zero advantages).
    generate, calls = _scripted([[False] * 6] * 3)
    rounds = run_rounds(4, 1.5, 3, 1, generate)
    assert [c[2] for c in calls] == [6, 6, 6] and rounds.stop == "max_rounds"
    assert select_groups(rounds.flat, 4) == [0, 1, 2, 3]


def test_one_round_with_no_oversampling_is_todays_stage():
    generate, calls = _scripted([[True, False, True, False]])
    rounds = run_rounds(4, 1.0, 1, 1, generate)
    assert calls == [(0, 0, 4)] and rounds.stop == "max_rounds"
    assert select_groups(rounds.flat, 4) == [0, 1, 2, 3]  # every group, in today's order


def test_every_rank_decides_on_the_largest_shortfall():
    # 2 ranks, 3 needed per rank (6 over ranks), oversample 1: round 0 draws 6, 3 per rank. This rank
    # finds 3 (enough); the other rank (scripted through the collectives) is 2 short, so both go on:
    # the shortfall is 2 x 2 ranks = 4; over ranks 4 of 6 were informative: ceil(4 x 6 / 4) = 6.
    generate, calls = _scripted([[True] * 3, [False] * 3])
    others = iter([2, 0])  # the other rank's shortfall after rounds 0 and 1
    rounds = run_rounds(3, 1.0, 4, 2, generate, sum_over_ranks=lambda xs: [xs[0] + 3, xs[1] + 1],
                        max_over_ranks=lambda x: max(x, next(others)))
    assert calls == [(0, 0, 6), (1, 6, 6)] and rounds.stop == "enough"


# ---------------------------------------------------------------------------------------------
# The round files and the assembled stage.


def _round(first_item: int, rewards: list[list[float]]) -> StageData:
    n, G = len(rewards), len(rewards[0])
    r = torch.tensor(rewards)
    return StageData([[first_item + g] for g in range(n)], [[100 + first_item + s] for s in range(n * G)],
                     [[-0.5 - s] for s in range(n * G)], r.flatten(), (r - r.mean(1, keepdim=True)).flatten(),
                     torch.ones(n * G, dtype=torch.bool), [first_item + g for g in range(n)], G)


def test_assemble_takes_the_kept_groups_across_rounds_in_order():
    a = _round(0, [[1.0, 1.0], [0.0, 1.0]])           # groups at positions 0, 1
    b = _round(10, [[1.0, 0.0], [0.0, 0.0], [0.5, 0.0]])  # positions 2, 3, 4
    data = assemble([a, b], [1, 2, 4])
    assert data.item_indices == [1, 10, 12] and data.prompts == [[1], [10], [12]]
    # Group 1 of round a is sequences 2, 3 of a; groups 0 and 2 of b are sequences 0, 1, 4, 5 of b.
    assert data.responses == [[102], [103], [110], [111], [114], [115]]
    assert data.behavior_logprobs == [[-2.5], [-3.5], [-0.5], [-1.5], [-4.5], [-5.5]]
    assert data.rewards.tolist() == [0.0, 1.0, 1.0, 0.0, 0.5, 0.0]
    assert data.advantages.tolist() == [-0.5, 0.5, 0.5, -0.5, 0.25, -0.25]
    assert data.group_size == 2 and data.trainer_logprobs is None and data.turns is None


def test_assemble_keeps_the_turns_of_an_environment_stage():
    a, b = _round(0, [[1.0, 0.0]]), _round(10, [[0.0, 0.0], [0.0, 1.0]])
    a.turns, b.turns = [[0], [1]], [[2], [3], [4], [5]]  # one marker per sequence, to follow them
    assert assemble([a, b], [0, 2]).turns == [[0], [1], [4], [5]]
    b.turns = None  # a round without turns (never mixed in practice) is single-turn: all its tokens turn 0,
    assert assemble([a, b], [0, 2]).turns == [[0], [1], [0], [0]]  # the one rule of the stage data's schema


def test_round_files_round_trip(tmp_path):
    part = _round(3, [[1.0, 0.0, 0.0]])
    assert load_round(tmp_path, 0, 0) is None                # nothing written: generate it
    save_round(tmp_path, 0, 0, part, {"num_tokens": 3, "generate_s": 0.5})
    data, record = load_round(tmp_path, 0, 0)
    assert record == {"num_tokens": 3, "generate_s": 0.5}
    assert data.responses == part.responses and data.rewards.equal(part.rewards)
    assert data.advantages.equal(part.advantages) and data.item_indices == [3]
    # A data file without its record (killed between the two writes) is an unfinished round.
    round_paths(tmp_path, 0, 0)[1].unlink()
    assert load_round(tmp_path, 0, 0) is None
    remove_rounds(tmp_path)
    assert not (tmp_path / "rounds").exists()


def test_a_damaged_round_record_names_the_file(tmp_path):
    save_round(tmp_path, 2, 1, _round(0, [[1.0, 0.0]]), {})
    record = round_paths(tmp_path, 2, 1)[1]
    record.write_text("{not json")
    with pytest.raises(StageDataError, match="round_02_rank1.json"):
        load_round(tmp_path, 2, 1)


# ---------------------------------------------------------------------------------------------
# Seeds and the plan.


def test_round_sampling_seeds():
    # Round 0 samples as a stage without dynamic sampling; later rounds, per rank, differ.
    assert seeds.rollout_round_sampling(5, 2, 0, 0) == seeds.rollout_sampling(5, 2, 0)
    later = {seeds.rollout_round_sampling(5, 2, rank, r) for rank in (0, 1) for r in (1, 2)}
    assert len(later) == 4 and seeds.rollout_sampling(5, 2, 0) not in later


def test_plan_rows():
    assert plan_rows(False, 32, 8, 2.0, 4) == [("dynamic sampling", "off")]
    rows = dict(plan_rows(True, 32, 8, 1.5, 4))
    assert rows["dynamic sampling"] == "on: keep groups with nonzero reward variance, at most 4 rounds per stage"
    assert rows["informative groups needed"] == "32 per stage"
    # 32 x 1.5 = 48 prompts x G 8 = 384 sequences; at most 4 rounds of 48: 1536 sequences.
    assert rows["round 0 draws"] == "48 prompts (1.5 x 32), 384 sequences"
    assert rows["sequences generated per stage"] == "384 .. 1536"
    assert dict(plan_rows(True, 32, 8, 1.0, 1))["later rounds draw"] == "none (one round)"


def test_rounds_dataclass_flattens_in_draw_order():
    rounds = Rounds(sizes=[2, 3], informative=[[True, False], [False, False, True]])
    assert rounds.flat == [True, False, False, False, True]


# ---------------------------------------------------------------------------------------------
# The generation phase in rounds, with a scripted "engine": item i's group of G = 2 is informative
# iff i is in INFORMATIVE.

INFORMATIVE = {1, 4, 5, 9, 13, 14}


def _fake_generate(calls):
    def generate(round_index, indices):
        calls.append((round_index, list(indices)))
        rewards = [[1.0, 0.0] if i in INFORMATIVE else [0.0, 0.0] for i in indices]
        part = _round(0, rewards)
        part.item_indices = list(indices)
        part.prompts = [[i] for i in indices]
        return part, {"num_tokens": 2 * len(indices), "generate_s": 1.0, "first_error": None}
    return generate


def _phase(stage_dir, calls, after_round=lambda: None):
    from mugrpo.stages.rounds import Ranks, generate_in_rounds

    # 4 needed, oversample 1.5: round 0 = items 0-5 (informative 1, 4, 5: p = 3/6), 1 missing: round 1
    # draws ceil(1 / (3/6)) = 2 items, 6-7, none informative (p = 3/8); round 2 draws ceil(1 x 8 / 3) = 3,
    # items 8-10: 9 is the 4th. Kept: items 1, 4, 5, 9.
    return generate_in_rounds(stage_dir, Ranks(), 4, 1.5, 5, lambda offset, size: list(range(offset, offset + size)),
                              _fake_generate(calls), after_round=after_round)


def test_generate_in_rounds_keeps_exactly_the_informative_groups(tmp_path):
    calls = []
    data, record, rounds = _phase(tmp_path, calls)
    assert calls == [(0, [0, 1, 2, 3, 4, 5]), (1, [6, 7]), (2, [8, 9, 10])]
    assert data.item_indices == [1, 4, 5, 9] and rounds.stop == "enough"
    assert data.rewards.tolist() == [1.0, 0.0] * 4
    assert record["num_tokens"] == 22 and record["generate_s"] == 3.0  # 11 groups x 2 sequences; 3 rounds
    assert record["first_error"] is None
    assert sum_records([{"c": [1, 2], "e": None}, {"c": [3, 4], "e": "tb"}, {"c": [0, 1], "e": "later"}]) == {
        "c": [4, 7], "e": "tb"}
    # an environment's counts, key by key; a key one round lacks counts 0 there
    assert sum_records([{"env": {"env/num_done": 3.0, "env/calls": 1.0}}, {"env": {"env/num_done": 2.0}}]) == {
        "env": {"env/calls": 1.0, "env/num_done": 5.0}}


def test_generate_in_rounds_resumes_between_rounds(tmp_path):
    class Killed(Exception):
        pass

    def die_after_second():
        if len(calls) == 2:
            raise Killed

    calls = []
    with pytest.raises(Killed):
        _phase(tmp_path / "stage", calls, die_after_second)
    resumed_calls = []
    data, record, rounds = _phase(tmp_path / "stage", resumed_calls)
    assert resumed_calls == [(2, [8, 9, 10])]     # rounds 0 and 1 read back, not generated again
    reference, _, _ = _phase(tmp_path / "ref", [])
    assert data.item_indices == reference.item_indices == [1, 4, 5, 9]
    assert data.responses == reference.responses and data.rewards.equal(reference.rewards)
    assert record["generate_s"] == 3.0              # the read-back rounds' clocks still count


def test_round_metrics():
    from mugrpo.stages.rounds import round_metrics

    # 11 groups generated (G = 2) of which 4 informative and 4 kept: 7 groups = 14 sequences not kept;
    # of 3.0 s generating 22 sequences, 14 / 22 x 3.0 = 1.909 s are theirs. Rewards over the 22
    # generated sequences: 4 ones (sum 4, squares 4): mean 4/22, std sqrt(4/22 - (4/22)^2) = 0.3857;
    # the kept 8 sequences hold the 4 ones: 0.5.
    rounds = Rounds(sizes=[6, 2, 3], informative=[[False, True, False, False, True, True], [False, False],
                                                  [False, True, False]])
    data = _round(0, [[1.0, 0.0]] * 4)
    record = {"generate_s": 3.0, "reward_sum": 4.0, "reward_sq_sum": 4.0, "num_sequences": 22}
    m = round_metrics(rounds, data, record, 4, 1)
    assert m["stage/informative_frac"] == 4 / 11 and m["stage/num_rounds"] == 3
    assert m["stage/num_informative_groups"] == 4 and m["stage/num_groups_needed"] == 4
    assert m["stage/num_extra_sequences"] == 14
    assert m["perf/extra_generate_s"] == pytest.approx(14 / 22 * 3.0)
    assert m["reward/mean"] == pytest.approx(4 / 22) and m["reward/std"] == pytest.approx(0.38569, abs=1e-5)
    assert m["stage/kept_reward_mean"] == 0.5


def test_generate_in_rounds_records_the_generated_rewards(tmp_path):
    # Rounds of the scripted engine: items 0-10, the 4 informative ones rewarded [1, 0]: 4 ones in 22.
    _, record, _ = _phase(tmp_path, [])
    assert (record["reward_sum"], record["reward_sq_sum"], record["num_sequences"]) == (4.0, 4.0, 22)


def test_stage_summary_line_shows_the_rounds(capsys):
    from mugrpo.observability.progress import Progress

    Progress(enabled=True).stage_summary(0, {"reward/mean": 0.1, "stage/informative_frac": 0.25,
                                             "stage/num_rounds": 3})
    assert "informative 0.25 of the groups generated in 3 round(s)" in capsys.readouterr().err
    Progress(enabled=True).stage_summary(0, {"reward/mean": 0.1})
    assert "informative" not in capsys.readouterr().err
