"""Start ``mugrpo serve`` as a subprocess for the tests (tests/rollout/test_remote.py, test_service.py):
``with serving(model_dir) as svc: ... svc.url ...``. The service picks a free port (``--port 0``) and
names it on stderr, so parallel tests never race for a port."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from mugrpo import faults

TESTS = Path(__file__).parent


@dataclass
class Service:
    proc: subprocess.Popen
    url: str = ""
    lines: list = field(default_factory=list)
    """Every stderr line so far."""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen (SIGSTOP) service dies too
            self.proc.kill()
        self.proc.wait(timeout=30)


def service_env(**extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    for key in faults.VARIABLES:
        env.pop(key, None)
    env.update(extra)
    return env


def start(model_dir, *args, engine: str = "hf", env=None, timeout_s: float = 300) -> Service:
    """Start a service and wait for its ``listening on URL`` line (or its exit: AssertionError with its stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "mugrpo", "serve", "--engine", engine, "--model", str(model_dir),
                             "--port", "0", *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env or service_env())
    svc, ready = Service(proc), threading.Event()

    def read():
        for line in proc.stderr:
            svc.lines.append(line)
            found = re.search(r"listening on (http://\S+)", line)
            if found:
                svc.url = found.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(timeout_s)
    if not svc.url:
        svc.kill()
        raise AssertionError("mugrpo serve did not start:\n" + "".join(svc.lines[-30:]))
    return svc


@contextlib.contextmanager
def serving(model_dir, *args, **kwargs):
    svc = start(model_dir, *args, **kwargs)
    try:
        yield svc
    finally:
        svc.kill()
