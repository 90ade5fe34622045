"""The calculator tool behind a 0.5 s wait, as a sandbox or an API answers (``task.tools=[async_tools:slow_calculate]``
with ``benchmarks/`` on the path; :mod:`benchmarks.async_stages`). Same name, schema and docstring as the
built-in ``calculate``, so the prompt's tool protocol is unchanged."""

import functools
import os
import time

from mugrpo.rollout.envs.builtin import calculate

LATENCY_S = float(os.environ.get("MUGRPO_BENCH_TOOL_LATENCY_S", "0.5"))
"""The tool's wait; ``MUGRPO_BENCH_TOOL_LATENCY_S`` sets another (:mod:`benchmarks.serving`'s agent runs)."""


@functools.wraps(calculate)
def slow_calculate(*args, **kwargs):
    time.sleep(LATENCY_S)
    return calculate(*args, **kwargs)
