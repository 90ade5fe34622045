"""Scoring counts as a typed record (mugrpo.stages.counts.ScoreCounts): named, summed key by key, and the
stage's reward metrics from them, by hand."""
import pytest

from mugrpo.stages.counts import ScoreCounts
from mugrpo.stages.rounds import sum_records

pytestmark = pytest.mark.unit


def test_record_round_trip_and_metrics_by_hand():
    counts = ScoreCounts(num_errors=1, num_timeouts=2, num_invalid=3, num_unparsable=4, num_scored=8,
                         per_reward={"a": {"sum": 6.0, "num_errors": 1, "num_timeouts": 0, "num_invalid": 0}})
    back = ScoreCounts.from_record(counts.as_record())
    assert back == ScoreCounts(1.0, 2.0, 3.0, 4.0, 8.0, 0.0, {"a": {"sum": 6.0, "num_errors": 1.0,
                                                                    "num_timeouts": 0.0, "num_invalid": 0.0}})
    m = back.metrics(["a"])
    assert m["reward/unparsable_frac"] == 0.5  # 4 of 8 scored
    assert m["reward/a/mean"] == 0.75  # 6 / 8
    assert back.num_failed == 6  # 1 + 2 + 3


def test_two_rounds_sum_key_by_key():
    one = ScoreCounts(num_errors=1, num_scored=4, per_reward={"a": {"sum": 1.0}}).as_record()
    two = ScoreCounts(num_invalid=2, num_scored=4, per_reward={"a": {"sum": 3.0}}).as_record()
    total = ScoreCounts.from_record(sum_records([{"counts": one}, {"counts": two}])["counts"])
    assert (total.num_errors, total.num_invalid, total.num_scored) == (1.0, 2.0, 8.0)
    assert total.per_reward["a"]["sum"] == 4.0


def test_a_round_persisted_as_a_positional_list_still_reads():
    # errors, timeouts, invalid, unparsable, scored, then per reward: sum, errors, timeouts, invalid
    legacy = [1, 0, 2, 3, 10, 5.0, 1, 0, 0]
    counts = ScoreCounts.from_record(legacy, ["a"])
    assert (counts.num_errors, counts.num_invalid, counts.num_unparsable, counts.num_scored) == (1, 2, 3, 10)
    assert counts.metrics(["a"])["reward/a/mean"] == 0.5
