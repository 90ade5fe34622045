"""Start ``mugrpo serve`` as a subprocess for the tests (tests/rollout/test_remote.py, test_service.py):
``with serving(model_dir) as svc: ... svc.url ...``. The service picks a free port (``--port 0``) and
names it on stderr, so parallel tests never race for a port. ``api_key="K"`` starts it with ``--api-key K``;
``svc.headers`` then carries the key (``httpx.get(svc.url + "/info", headers=svc.headers)``)."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mugrpo import faults

TESTS = Path(__file__).parent


@dataclass
class Service:
    proc: subprocess.Popen
    url: str = ""
    lines: list = field(default_factory=list)
    """Every stderr line so far."""
    api_key: Optional[str] = None

    @property
    def headers(self) -> dict:
        """The request headers the service needs (its key, if it has one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, as a user's Ctrl-C or a job scheduler would; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

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


def start(model_dir, *args, engine: str = "hf", env=None, timeout_s: float = 300,
          api_key: Optional[str] = None, python: str = sys.executable) -> Service:
    """Start a service and wait for its ``listening on URL`` line (or its exit: AssertionError with its stderr).
    ``python``: the interpreter (e.g. .venv-vllm's for ``engine="vllm"``)."""
    key_args = ["--api-key", api_key] if api_key else []
    if "--dtype" not in args:  # the tests' trainers pin rollout.dtype=float32; auto is bf16 on an AVX512-BF16 CPU
        key_args += ["--dtype", "float32"]
    proc = subprocess.Popen([python, "-m", "mugrpo", "serve", "--engine", engine, "--model", str(model_dir),
                             "--port", "0", *key_args, *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=env or service_env())
    svc, ready = Service(proc, api_key=api_key), threading.Event()

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
