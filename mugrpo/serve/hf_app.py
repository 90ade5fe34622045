"""The HF service: a FastAPI app with the routes of vLLM's server that the trainer uses (``GET /health``,
``GET /v1/models``, ``POST /v1/completions``) and mugrpo's (:mod:`mugrpo.serve.common`), over the in-process
HF engine (:mod:`mugrpo.rollout.engines.hf`).

The engine runs in one worker thread, one call at a time (generations and weight loads queue), so the event
loop keeps answering ``/info`` and ``/health`` while it works. ``/info``'s ``pending`` and
``since_progress_s`` (seconds since the engine's last decode step while a request is pending) tell a client
a busy service from a stuck one. A client that disconnects has its request cancelled: the engine's progress
callback raises at the next decode step (or the request never starts, if it was still queued).

Bitwise: a request's ``mugrpo`` field carries the trainer's ``rollout.batch_size`` and the index of its
first chunk, so the engine seeds each chunk as the in-process engine would (engines/hf.py ``first_chunk``).
Log-probs cross as JSON numbers (a float's shortest round-trip repr): they arrive bit for bit.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import sys
import threading
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mugrpo.faults import maybe_die
from mugrpo.serve.common import (ServiceState, add_error_handlers, add_middleware, damaged_on_failure,
                                 header_timeout_protocol, log, mugrpo_router, parse_body, url_of)
from mugrpo.serve.protocol import CompletionRequest, Limits, request_problem
from mugrpo.serve.weights import WeightsRefused, check_against, check_tensors, header_of_files, spec_of_parameters


class Cancelled(Exception):
    """The client left (or the service is stopping): the engine call ends at its next decode step."""


class EngineThread:
    """One daemon thread that runs engine calls in order; ``await run(fn)`` from the event loop. A daemon, so
    a call stuck for good (a hung engine) cannot keep the process alive past a stop."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        threading.Thread(target=self._loop, name="mugrpo-engine", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, future, loop = self._jobs.get()
            self._idle.clear()
            try:
                result, error = fn(), None
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                result, error = None, exc
            finally:
                self._idle.set()
            loop.call_soon_threadsafe(_settle, future, result, error)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call runs (True), or ``timeout_s`` passed (False: a call is stuck)."""
        return self._idle.wait(timeout_s)

    async def run(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((fn, future, loop))
        return await future


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _watch_disconnect(receive, cancelled: threading.Event) -> None:
    """Set ``cancelled`` when the client goes away (the ASGI channel says ``http.disconnect``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            cancelled.set()
            return


def build_app(engine, tokenizer, state: ServiceState, limits: Limits, security: dict) -> FastAPI:
    """The HF service's app (``security``: see :func:`mugrpo.serve.common.add_middleware`)."""
    from mugrpo.rollout.engines.base import SamplingConfig

    worker = EngineThread()
    stopping = threading.Event()
    spec = spec_of_parameters(engine.model.named_parameters())
    default_batch_size = engine.batch_size
    name = state.info["model"]

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stopping, app.state.worker = stopping, worker  # serve_hf's stop: see _Server
    add_error_handlers(app)
    add_middleware(app, state, security)

    async def load(files, version: int) -> None:
        check_against(header_of_files(files), spec)  # the headers: nothing read, nothing changed

        def work() -> None:
            from safetensors.torch import load_file

            try:
                tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
            except Exception as exc:  # noqa: BLE001 - unreadable after all: nothing changed yet
                raise WeightsRefused(400, f"load_weights: reading {files[0].name} failed "
                                          f"({type(exc).__name__}); nothing was loaded") from None
            check_tensors(tensors, spec)  # what was read is what was checked
            try:
                engine.load_weights(tensors.items())
            except Exception as exc:  # noqa: BLE001 - midway: the model may be half-updated
                raise damaged_on_failure(state, f"version {version}", exc) from exc

        await worker.run(work)

    app.include_router(mugrpo_router(state, load))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "mugrpo", "root": name,
                                            "max_model_len": limits.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(CompletionRequest, await request.body())
        if body.model is not None and body.model != name:
            return JSONResponse({"error": f"model: this service serves {name!r}, not {body.model!r}"}, 404)
        problem = request_problem(body, limits, len(tokenizer))
        if problem:
            return JSONResponse({"error": f"bad request: {problem}"}, 400)
        prompts, ext = body.prompts(), body.mugrpo
        sampling = SamplingConfig(n=body.n, temperature=body.temperature, top_p=body.top_p,
                                  top_k=max(body.top_k, 0), max_new_tokens=body.max_tokens, seed=body.seed or 0,
                                  stop=body.stops())
        cancelled = threading.Event()

        def progress(_done: int = 0) -> None:
            if cancelled.is_set() or stopping.is_set():
                raise Cancelled()
            state.beat()

        def work():
            if cancelled.is_set() or stopping.is_set():
                raise Cancelled()  # the client left while the request waited for its turn
            maybe_die("serve_generate")  # the fault tests' service death, freeze or stuck engine mid-request
            engine.batch_size = ext.batch_size if ext and ext.batch_size else default_batch_size
            return engine.generate(prompts, sampling, progress=progress,
                                   max_new_tokens=ext.max_tokens if ext else None,
                                   first_chunk=ext.first_chunk if ext else 0)

        watcher = asyncio.create_task(_watch_disconnect(request.receive, cancelled))
        try:
            groups = await worker.run(work)
        except Cancelled:
            return Response(status_code=499)  # nobody is listening; the code is nginx's "client closed"
        except Exception as exc:  # noqa: BLE001 - the engine failed (e.g. out of memory); the service stays up
            log(f"/v1/completions failed: {type(exc).__name__}: {exc}")
            return JSONResponse({"error": f"the engine failed: {type(exc).__name__}: {exc}"}, 500)
        finally:
            watcher.cancel()
        return answer_of(groups, body, name, tokenizer)

    return app


def answer_of(groups, body: CompletionRequest, name: str, tokenizer) -> dict:
    """The OpenAI completions answer, choices prompt-major (index = prompt i * n + sample j), as vLLM's."""
    choices = []
    for group in groups:
        for c in group:
            logprobs = None if body.logprobs is None else {
                "token_logprobs": c.behavior_logprobs, "tokens": [f"token_id:{t}" for t in c.token_ids],
                "text_offset": [], "top_logprobs": []}
            choices.append({"index": len(choices), "finish_reason": c.finish_reason, "stop_reason": None,
                            "text": tokenizer.decode(c.token_ids, skip_special_tokens=body.skip_special_tokens),
                            "token_ids": c.token_ids if body.return_token_ids else None, "logprobs": logprobs})
    prompt_tokens = sum(len(p) for p in body.prompts())
    completion_tokens = sum(len(c.token_ids) for group in groups for c in group)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def serve_hf(args, model_path: str, tokenizer, state: ServiceState, security: dict, sock) -> None:
    """Load the HF engine and serve it on ``sock`` until Ctrl-C / SIGTERM."""
    import uvicorn
    from transformers import AutoConfig

    from mugrpo.config.rollout_sections import RolloutConfig
    from mugrpo.rollout.engines import make_engine

    context = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None) or 4096
    max_model_len = args.max_model_len or min(context, 4096)
    state.info["max_model_len"] = max_model_len
    cfg = RolloutConfig(engine="hf", dtype=state.info["dtype"], batch_size=args.batch_size)
    engine = make_engine("hf", model_path, tokenizer, cfg, seed=args.seed)
    limits = Limits(max_n=args.max_n, max_seqs=args.max_seqs, max_model_len=max_model_len)
    app = build_app(engine, tokenizer, state, limits, security)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=5,
                            timeout_graceful_shutdown=5, h11_max_incomplete_event_size=64 * 1024,
                            http=header_timeout_protocol(args.header_timeout_s))

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.stopping.set()  # the engine's call in flight ends at its next decode step
            super().handle_exit(sig, frame)

    # uvicorn handles Ctrl-C / SIGTERM (a graceful stop), then raises the signal again under the handlers it
    # found: with these, that ends nothing more and the command exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    log(f"listening on {url_of(sock)}")
    _Server(config).run(sockets=[sock])
    # torch aborts the process ("terminate called without an active exception") if it exits while a thread
    # still computes: wait for the engine's call to end.
    if not app.state.worker.wait_idle(30):
        log("stopped; the engine was still busy after 30 s (a stuck call), so the process ends without cleanup")
        sys.stderr.flush()
        os._exit(1)
    log("stopped")
