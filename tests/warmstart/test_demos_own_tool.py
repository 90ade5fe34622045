"""docs/WARMSTART.md's "Your own tool" example, run as written: the tool
module and the script that writes demonstrations with the task's rendering. The rows load as
demonstrations, render with a trained answer, carry the prompt RL renders, and are the RL task's data."""
import json
import re
import sys
from pathlib import Path

from mugrpo.config import load_config
from mugrpo.models.loading import load_tokenizer
from mugrpo.rollout.tasks import build_task, render_messages
from mugrpo.warmstart.data import load_demonstrations
from mugrpo.warmstart.render import render_demonstrations

DOC = Path(__file__).resolve().parents[2] / "docs" / "WARMSTART.md"


def _example_blocks() -> tuple[str, str]:
    section = DOC.read_text().split("**Your own tool.**", 1)[1].split("**Rejection sampling.**", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    return blocks[0], blocks[1]


def test_the_own_tool_example_writes_demonstrations_rl_can_use(tmp_path, tiny_model_dir, monkeypatch):
    tool_module, script = _example_blocks()
    (tmp_path / "my_tools.py").write_text(tool_module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    exec(compile(script, "WARMSTART.md example", "exec"), {})
    path = tmp_path / "demos" / "price.jsonl"
    demos = load_demonstrations(str(path))
    assert len(demos) == 256
    examples, counts = render_demonstrations(load_tokenizer(tiny_model_dir), demos, max_length=4096)
    assert counts["num_dropped"] == 0 and all(e.num_loss_tokens > 0 for e in examples)
    cfg = load_config(overrides=["task.tools=[my_tools:price]", "task.few_shot=[]"])
    row = json.loads(path.read_text().splitlines()[0])
    prompt = render_messages(row["question"], cfg.task)  # the prompt RL renders for this question
    assert row["messages"][:len(prompt)] == prompt
    assert row["messages"][-1]["content"] == f"The answer is \\boxed{{{row['answer']}}}."
    task = build_task(load_config(overrides=["task.kind=math", f"task.name={path}", "task.eval_size=8"]).task)
    assert len(task.items) + len(task.eval_items) <= 256 and task.eval_items[0].answer
    sys.modules.pop("my_tools", None)
