"""A rollout service: one in-process engine behind a small HTTP + JSON server (``mugrpo serve``), and the
wire format the remote engine (:mod:`mugrpo.rollout.engines.remote`) speaks to it.

Endpoints (docs/SERVING.md is the reference):

- ``GET /info``: the model (name, path, config fingerprint), the tokenizer fingerprint, the engine kind
  and dtype, the weights version and file now loaded, a ``boot_id`` that changes at every start (a
  restart is seen as a new boot_id), and mugrpo's version.
- ``POST /generate``: token-id prompts and the sampling fields of
  :class:`~mugrpo.rollout.engines.base.SamplingConfig`, optional per-prompt ``max_new_tokens``; answers
  token ids, behaviour log-probs and a finish reason per completion, with the weights version that
  generated them. Nothing is tokenized or detokenized here (stop strings aside, which the engine
  checks on its own decoded text).
- ``POST /load_weights``: a safetensors file (or a folder of them) and a version number; the engine
  loads it and the service reports that version from then on.

One engine call at a time (a lock): generations and weight loads queue; ``/info`` answers while the
engine works, which is how a client tells a busy service from a hung or dead one, and it says how long
ago the engine last made progress (``since_progress_s``: seconds since its last decode step while a
generate request is pending, else null), which is how a client tells a working engine from a stuck one. Log-probs cross as
JSON numbers: Python writes a float's shortest round-trip repr, so they arrive bit for bit.

This module knows nothing about training, rewards or the config; :mod:`mugrpo.serve` builds the
engine and starts the server.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

from mugrpo.faults import maybe_die
from mugrpo.rollout.engines.base import Completion, SamplingConfig

_VOLATILE_CONFIG_KEYS = {"_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype",
                         "_commit_hash", "use_cache"}
"""Config keys that differ between copies of one architecture (where it was saved from, the dtype it was
saved in): left out of :func:`model_fingerprint`, which the weights pushed every stage make sufficient."""

SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "seed", "stop")


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (16 hex digits) of the vocabulary, the special tokens and the pad / EOS ids: two tokenizers
    with one fingerprint turn text into the same ids."""
    data = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(tokenizer.all_special_tokens),
            "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def model_fingerprint(model_path: str, trust_remote_code: bool = False) -> str:
    """sha256 (16 hex digits) of the model's config, where it was saved from and its dtype aside: the
    architecture the pushed weights must fit."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).to_dict()
    kept = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


# -- the wire format (both sides) ----------------------------------------------------------------------

def sampling_to_json(sampling: SamplingConfig) -> dict:
    return {k: (list(v) if k == "stop" else v) for k, v in asdict(sampling).items()}


def sampling_from_json(data: Any) -> SamplingConfig:
    if not isinstance(data, dict) or set(data) - set(SAMPLING_FIELDS):
        raise ValueError(f"'sampling' must be an object with keys among {', '.join(SAMPLING_FIELDS)}")
    values = dict(data)
    if "stop" in values:
        values["stop"] = tuple(values["stop"])
    return SamplingConfig(**values)


def completions_to_json(completions: list[list[Completion]]) -> list:
    return [[{"token_ids": c.token_ids, "logprobs": c.behavior_logprobs, "finish_reason": c.finish_reason}
             for c in group] for group in completions]


def completions_from_json(data: Any, num_prompts: int, n: int) -> list[list[Completion]]:
    """Check an answer's shape (``num_prompts`` groups of ``n``, one log-prob per token, int ids, a known
    finish reason) and build the completions; ValueError names what is wrong."""
    if not isinstance(data, list) or len(data) != num_prompts:
        raise ValueError(f"expected {num_prompts} groups of completions, got "
                         f"{len(data) if isinstance(data, list) else type(data).__name__}")
    out = []
    for i, group in enumerate(data):
        if not isinstance(group, list) or len(group) != n:
            raise ValueError(f"prompt {i}: expected {n} completions")
        row = []
        for j, c in enumerate(group):
            ids, logprobs = (c.get("token_ids"), c.get("logprobs")) if isinstance(c, dict) else (None, None)
            if not (isinstance(ids, list) and isinstance(logprobs, list) and len(ids) == len(logprobs)
                    and all(type(t) is int for t in ids) and all(isinstance(x, (int, float)) for x in logprobs)):
                raise ValueError(f"prompt {i}, completion {j}: token_ids and logprobs must be lists of equal "
                                 "length (ints and numbers)")
            if c.get("finish_reason") not in ("stop", "length"):
                raise ValueError(f"prompt {i}, completion {j}: finish_reason {c.get('finish_reason')!r}")
            row.append(Completion(ids, [float(x) for x in logprobs], c["finish_reason"]))
        out.append(row)
    return out


# -- the server ----------------------------------------------------------------------------------------

@dataclass
class ServiceState:
    """What a service holds: its engine, what it tells clients, and the weights it has loaded."""

    engine: Any
    info: dict
    """model, model_path, model_fingerprint, tokenizer_fingerprint, engine, dtype, mugrpo_version."""
    vocab_size: int
    weights_version: int = 0
    """0: the weights the service started with; then the version of the last file loaded."""
    weights_path: Optional[str] = None
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: int = 0
    """Generate requests taken and not yet answered (waiting for the lock, or in the engine)."""
    beat_at: float = 0.0
    """``time.monotonic()`` of the engine's last sign of progress (a decode step), or of the first pending
    request's arrival: ``/info``'s ``since_progress_s`` counts from it while a request is pending."""
    _beat_lock: threading.Lock = field(default_factory=threading.Lock)

    def describe(self) -> dict:
        with self._beat_lock:
            stalled = time.monotonic() - self.beat_at if self.pending else None
        return {**self.info, "weights_version": self.weights_version, "weights_path": self.weights_path,
                "boot_id": self.boot_id, "pending": self.pending, "since_progress_s": stalled}

    def beat(self, _done: int = 0) -> None:
        """The engine's progress callback (after every decode step): the service is working, not stuck."""
        self.beat_at = time.monotonic()

    @contextlib.contextmanager
    def _pending(self):
        with self._beat_lock:
            if not self.pending:
                self.beat_at = time.monotonic()
            self.pending += 1
        try:
            yield
        finally:
            with self._beat_lock:
                self.pending -= 1

    def load(self, request: dict) -> dict:
        path, version = request.get("path"), request.get("version")
        if not isinstance(path, str) or type(version) is not int or version < 1:
            raise ValueError("load_weights takes {path: a safetensors file or folder, version: an integer >= 1}")
        files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
        if not files or not all(f.is_file() for f in files):
            raise ValueError(f"no safetensors file at {path} (is weights_dir shared between the trainer and "
                             "this service?)")
        from safetensors.torch import load_file

        with self.lock:
            for f in files:
                self.engine.load_weights(load_file(str(f)).items())
            self.weights_version, self.weights_path = version, path
        log(f"loaded weights version {version} from {path}")
        return {"weights_version": version, "boot_id": self.boot_id}

    def generate(self, request: dict) -> dict:
        prompts, limits = request.get("prompts"), request.get("max_new_tokens")
        if not (isinstance(prompts, list) and prompts and all(
                isinstance(p, list) and p and all(type(t) is int and 0 <= t < self.vocab_size for t in p)
                for p in prompts)):
            raise ValueError(f"'prompts' must be a non-empty list of non-empty lists of token ids in "
                             f"0..{self.vocab_size - 1}")
        sampling = sampling_from_json(request.get("sampling", {}))
        if limits is not None and not (isinstance(limits, list) and len(limits) == len(prompts)
                                       and all(type(m) is int and 1 <= m <= sampling.max_new_tokens for m in limits)):
            raise ValueError("'max_new_tokens' must be null or one integer in 1..sampling.max_new_tokens per prompt")
        extra = {}
        if self.info["engine"] == "hf":  # the HF engine's seeds follow the chunk index (engines/hf.py)
            extra["first_chunk"] = int(request.get("first_chunk", 0))
        with self._pending(), self.lock:
            maybe_die("serve_generate")  # the fault tests' service death, freeze or stuck engine mid-request
            batch_size = request.get("batch_size")
            if type(batch_size) is int and batch_size >= 1 and hasattr(self.engine, "batch_size"):
                self.engine.batch_size = batch_size  # the trainer's rollout.batch_size: the same chunks
            completions = self.engine.generate(prompts, sampling, progress=self.beat, max_new_tokens=limits, **extra)
            version = self.weights_version
        return {"completions": completions_to_json(completions), "weights_version": version, "boot_id": self.boot_id}


def log(message: str) -> None:
    print(f"[mugrpo serve] {message}", file=sys.stderr, flush=True)


class _Handler(BaseHTTPRequestHandler):
    state: ServiceState  # set on the subclass make_server builds
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - http.server's name; requests are not logged
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.rstrip("/") == "/info":
            self._answer(200, self.state.describe())
        else:
            self._answer(404, {"error": f"unknown path {self.path}; GET /info, POST /generate, POST /load_weights"})

    def do_POST(self):  # noqa: N802 - http.server's name
        route = {"/generate": self.state.generate, "/load_weights": self.state.load}.get(self.path.rstrip("/"))
        if route is None:
            self._answer(404, {"error": f"unknown path {self.path}; POST /generate or /load_weights"})
            return
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if not isinstance(request, dict):
                raise ValueError("the request body must be a JSON object")
            self._answer(200, route(request))
        except (ValueError, TypeError, KeyError) as exc:  # a bad request: the client's mistake
            self._answer(400, {"error": f"{type(exc).__name__}: {exc}"})
        except Exception as exc:  # noqa: BLE001 - the engine failed; the service stays up and says why
            log(f"{self.path} failed: {type(exc).__name__}: {exc}")
            self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})


def make_server(state: Optional[ServiceState], host: str, port: int) -> ThreadingHTTPServer:
    """Bind ``host:port`` (0: a free port; ``server.server_address`` says which). Raises OSError when the
    port is taken. ``state`` may be set later (``server.RequestHandlerClass.state``), before serving."""
    handler = type("ServiceHandler", (_Handler,), {"state": state})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
