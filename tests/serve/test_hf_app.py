"""Pieces of the HF service (mugrpo.serve.hf_app) checked in this process: the engine thread and the
answer's layout. The service itself is tested as a subprocess in tests/rollout/test_service.py."""
import asyncio
import threading

import pytest

from mugrpo.rollout.engines.base import Completion
from mugrpo.serve.hf_app import EngineThread, answer_of
from mugrpo.serve.protocol import CompletionRequest

pytestmark = pytest.mark.unit


def test_engine_calls_run_one_at_a_time_in_order_on_one_thread():
    worker, seen = EngineThread(), []

    def call(i):
        def fn():
            seen.append((i, threading.current_thread().name))
            if i == 1:
                raise ValueError("engine error")
            return i
        return fn

    async def scenario():
        return await asyncio.gather(*(worker.run(call(i)) for i in range(3)), return_exceptions=True)

    results = asyncio.run(scenario())
    assert results[0] == 0 and isinstance(results[1], ValueError) and results[2] == 2
    assert seen == [(0, "mugrpo-engine"), (1, "mugrpo-engine"), (2, "mugrpo-engine")]
    assert worker.wait_idle(1)


class _Chars:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + t) for t in ids)


def test_choices_are_prompt_major_as_vllms():
    groups = [[Completion([1], [-0.5], "stop"), Completion([2, 3], [-1.0, -0.25], "length")],
              [Completion([4], [-2.0], "stop"), Completion([], [], "length")]]
    answer = answer_of(groups, CompletionRequest(prompt=[[9], [8, 7]], n=2), "m", _Chars())
    assert [(c["index"], c["token_ids"], c["text"], c["finish_reason"]) for c in answer["choices"]] == \
        [(0, [1], "a", "stop"), (1, [2, 3], "bc", "length"), (2, [4], "d", "stop"), (3, [], "", "length")]
    assert answer["choices"][1]["logprobs"]["token_logprobs"] == [-1.0, -0.25]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
