"""The first failure of each kind of a stage's environments is printed once per stage, with its
traceback; the counts are the stage's env/* metrics."""
from types import SimpleNamespace

from mugrpo.stages.generation import RoundGenerator


def test_the_first_error_of_each_kind_is_printed_once_per_stage(capsys):
    gen = RoundGenerator(None, SimpleNamespace(rank=0, size=1), None, None, None, None)
    first = SimpleNamespace(env_problems={"env_error": "Traceback ...\nRuntimeError: step broke",
                                          "start_error": "Hostile.reset raised on item '1': ..."})
    later = SimpleNamespace(env_problems={"env_error": "Traceback ...\nRuntimeError: again", "close_error": "c"})
    gen._report_env_problems(0, first)
    gen._report_env_problems(0, later)  # a second round of the same stage: only the new kind
    gen._report_env_problems(1, later)  # a new stage: each kind again
    out = capsys.readouterr().out
    assert out.count("stage 0: environment env error") == 1 and "RuntimeError: step broke" in out
    assert "RuntimeError: again" in out and out.count("RuntimeError: again") == 1  # in stage 1 only
    assert out.count("environment start error") == 1 and out.count("environment close error") == 2
