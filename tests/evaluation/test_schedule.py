"""When a training run evaluates (mugrpo.evaluation.schedule): the in-loop rule and what a resumed run
evaluates again at its start, on hand-made eval sections and states."""
from types import SimpleNamespace

import pytest

from mugrpo.evaluation.schedule import due_in_loop, evaluated_again_at_start, evaluates_at_start

pytestmark = pytest.mark.unit


def _eval(at_start=True, every_updates=0, num_items=8):
    return SimpleNamespace(at_start=at_start, every_updates=every_updates, num_items=num_items)


def test_due_in_loop_at_update_zero_follows_at_start():
    assert due_in_loop(_eval(at_start=True), 0)
    assert not due_in_loop(_eval(at_start=False, every_updates=4), 0)  # 0 % 4 == 0, but update 0 is at_start's


def test_due_in_loop_every_n_updates():
    ev = _eval(every_updates=4)
    # multiples of 4 among 1..12: 4, 8, 12
    assert [u for u in range(1, 13) if due_in_loop(ev, u)] == [4, 8, 12]
    assert not any(due_in_loop(_eval(every_updates=0), u) for u in range(1, 13))  # 0: off


def test_evaluated_again_at_start_needs_evaluation_on():
    assert evaluated_again_at_start(_eval(every_updates=4), 8)
    assert not evaluated_again_at_start(_eval(every_updates=4), 7)
    assert not evaluated_again_at_start(_eval(every_updates=4, num_items=0), 8)  # num_items=0: evaluation off
    assert evaluated_again_at_start(_eval(at_start=True), 0)


def test_evaluates_at_start_when_due_or_pending():
    ev = _eval(every_updates=4)
    assert evaluates_at_start(ev, SimpleNamespace(update=8, eval_pending=False))  # due: 8 % 4 == 0
    assert not evaluates_at_start(ev, SimpleNamespace(update=6, eval_pending=False))  # 6 % 4 == 2
    # a stop abandoned the stage end's evaluation at update 6: run it again
    assert evaluates_at_start(ev, SimpleNamespace(update=6, eval_pending=True))
    # with evaluation off, never, pending or not
    assert not evaluates_at_start(_eval(every_updates=4, num_items=0), SimpleNamespace(update=6, eval_pending=True))
