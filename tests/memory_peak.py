"""The peak resident memory of a command, measured in a process of its own (a memory bound, not a timing)."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
MEMORY_SCRIPT = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
"""


def peak_rss_kib(command: list) -> tuple[int, int, str]:
    """(exit code, peak resident memory in KiB, its output's tail) of ``command``; tests/ on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in ("MUGRPO_DIE_AT", "MUGRPO_STOP_AT"):
        env.pop(key, None)
    r = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, *map(str, command)], capture_output=True, text=True,
                       env=env)
    code, kib = r.stdout.split()
    return int(code), int(kib), r.stderr
