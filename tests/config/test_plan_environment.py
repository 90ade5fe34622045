"""``mugrpo plan`` for an environment run: the template tokens of one environment turn (the model's
tokenizer) and how many policy turns the budget allows at the per-turn cap (env.max_tokens_per_turn)."""
from mugrpo.cli import main
from mugrpo.models.loading import load_tokenizer
from mugrpo.rollout.envs.render import env_turn_ids


def test_plan_shows_the_environment_turn_template_and_the_turns_the_budget_allows(tiny_model_dir, capsys):
    # the calculator has tools: its turn is a tool message (rendered as a user turn by a template without tools)
    tool_turn = [{"role": "tool", "name": "tool", "content": ""}]
    template = len(env_turn_ids(load_tokenizer(tiny_model_dir), tool_turn, True))
    assert main(["plan", f"model.name={tiny_model_dir}", "task.env=calculator", "rollout.max_new_tokens=100",
                 "env.max_tokens_per_turn=20", "env.max_turns=8"]) == 0
    out = capsys.readouterr().out
    assert f"{template} tokens per environment turn" in out
    # k turns fit when 20 k + template (k - 1) <= 100
    fit = (100 + template) // (20 + template)
    assert f"{fit} policy turns at the cap within rollout.max_new_tokens=100" in out
    assert "policy turn cap" in out and "20 tokens" in out
