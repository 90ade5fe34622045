"""The C heap's settings (mugrpo/heap.py): freed tensors go back to the system."""
import subprocess
import sys

import pytest

from mugrpo import heap

# Interleaved 2 MiB tensors, every other one freed: on the heap the freed ones are holes that stay resident;
# as mappings of their own they go back to the system. Prints the resident MiB the freed half still holds.
SCRIPT = """
import sys, torch
from mugrpo import heap
if sys.argv[1] == "mapped":
    assert heap.keep_large_blocks_mapped()
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
torch.ones(1 << 19)  # one 2 MiB block freed at once: glibc's own threshold rises to it
kept, freed = [], []
for i in range(200):
    (kept if i % 2 else freed).append(torch.ones(1 << 19))  # 2 MiB each, every page touched
before = rss()
del freed
print(round(before - rss()))
"""


def _released_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(heap._libc() is None, reason="glibc only")
def test_freed_large_tensors_go_back_to_the_system_once_blocks_are_kept_mapped():
    # 100 freed tensors of 2 MiB = 200 MiB: all of it back when each was a mapping of its own, little when
    # they were holes in the heap between the kept ones
    assert _released_mib("mapped") >= 190
    assert _released_mib("heap") <= 50


@pytest.mark.unit
def test_trim_and_the_setting_answer_without_glibc(monkeypatch):
    monkeypatch.setattr(heap, "_libc", lambda: None)
    assert heap.trim() is False and heap.keep_large_blocks_mapped() is False
