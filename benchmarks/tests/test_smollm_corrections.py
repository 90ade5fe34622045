"""The SmolLM2 corrections benchmark's bookkeeping (benchmarks/smollm/corrections.py): its commands
(every method replays the seed's source with the same data keys) and its summary, on hand-made
metrics (no model, no engine)."""

import pytest

from benchmarks.smollm import corrections
from mugrpo.config import load_config
from mugrpo.stages.replay import MATCH_KEYS, _get

pytestmark = pytest.mark.bench  # a benchmark's bookkeeping: `pytest -m bench benchmarks/tests` runs it

Z = corrections.Sizing(eval_items=64, eval_every=64)


def _config(cmd):
    return load_config(cmd[cmd.index("--preset") + 1], overrides=[a for a in cmd[cmd.index("--run-dir") + 2:]
                                                                  if "=" in a])


def test_every_method_replays_the_source_with_the_keys_a_replay_must_match():
    source_cmd = corrections.command(corrections.SOURCE, 0, corrections.LRS[0], Z, generate=True)
    assert "--replay" not in source_cmd
    source = _config(source_cmd)
    assert source.loss.behavior_logprobs == "trainer" and source.eval.at_start  # the source evaluates the start
    for name in corrections.METHODS:
        for lr in corrections.LRS:
            cmd = corrections.command(name, 0, lr, Z, generate=False)
            assert cmd[cmd.index("--replay") + 1] == source_cmd[source_cmd.index("--run-dir") + 1]
            cfg = _config(cmd[:cmd.index("--replay")] + cmd[cmd.index("--replay") + 2:])
            assert [_get(cfg, k) for k in MATCH_KEYS] == [_get(source, k) for k in MATCH_KEYS], name
            assert cfg.optim.lr == lr and cfg.schedule.updates_per_stage == 64 and not cfg.eval.at_start


def test_summary_means_over_updates_with_loss_tokens_then_over_seeds():
    def run(seed, final, masked_by_pos):
        ups = [{"update": p, "update_in_stage": p, "loss/kl_behavior": 0.1 * p if m is not None else None,
                "loss/ratio_mean_neg": 1.0, "loss/veto_token_frac": m, "loss/correction_masked_frac": None,
                "loss/clip_frac_low": 0.0 if m is not None else None, "loss/clip_frac_high": 0.0}
               for p, m in enumerate(masked_by_pos)]
        return {"method": "mu-grpo", "seed": seed, "lr": 2e-5, "complete": True, "generated": False,
                "updates": ups, "evals": [{"update": 8, "greedy_acc": final, "response_len_mean": 100.0}],
                "wall_s": 1.0}

    # mu = 8: quarters of 2 positions. Seed 0 masks 0.2 at positions 6 and 7 (the last quarter); seed 1
    # has no loss tokens at position 7 (None: skipped, not a zero) and masks 0.4 at position 6.
    result = {"sizing": {"stale_mu": 8, "updates": 8},
              "runs": {"a": run(0, 0.5, [0.0] * 6 + [0.2, 0.2]), "b": run(1, 0.3, [0.0] * 6 + [0.4, None])}}
    s = corrections.summarise(result)["mu-grpo@2e-05"]
    assert s["final_greedy_acc"]["mean"] == pytest.approx(0.4) and s["final_greedy_acc"]["std"] == pytest.approx(0.1)
    assert s["masked_frac_last_quarter"]["values"] == pytest.approx([0.2, 0.4])
    assert s["masked_frac"]["values"] == pytest.approx([0.4 / 8, 0.4 / 7])  # seed 1: 7 updates with tokens
    assert s["kl_by_quarter"][3]["values"] == pytest.approx([0.65, 0.6])  # (0.6 + 0.7) / 2; position 6 only
    assert "| mu-grpo | 2e-05 (1.3e-03) | 2 | 0.400 ± 0.100 (s0 0.500, s1 0.300) |" in corrections.table(
        {"summary": corrections.summarise(result)})
