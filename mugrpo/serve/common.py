"""What both service engines add to their ASGI app: the key check, the body bound, the weights-version
headers, the gate between generation and weight loads, and mugrpo's routes (``GET /info``,
``POST /load_weights``). :mod:`mugrpo.serve.hf_app` puts them on its FastAPI app, :mod:`mugrpo.serve.vllm_app`
on vLLM's own.

The gate: requests on the generation paths hold a lease while they run; a weight load waits until none
does, and new ones wait until the load is over. So every answer comes from one weights version, the one
its ``x-mugrpo-weights-version`` header names. A load whose copy failed after its checks passed (a
disk or memory error midway) leaves the model half-updated: the service then refuses generation with 503
until a complete version loads, rather than serve wrong weights under the old version number.

This module knows nothing about the engines' internals.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mugrpo.serve.weights import WeightsRefused, files_inside

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/inference/")
"""Paths that run the engine: they take the gate's lease, and are refused while the weights are damaged."""

VERSION_HEADER, BOOT_HEADER = "x-mugrpo-weights-version", "x-mugrpo-boot-id"


def url_of(sock) -> str:
    """The URL a listening socket answers at."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def log(message: str) -> None:
    print(f"[mugrpo serve] {message}", file=sys.stderr, flush=True)


@dataclass
class ServiceState:
    """What a service tells clients and the weights it holds (one per process)."""

    info: dict
    """model (as served), model_fingerprint, tokenizer_fingerprint, engine, dtype, max_model_len,
    mugrpo_version: fixed at start."""
    weights_dir: str
    weights_version: int = 0
    """0: the weights the service started with; then the version of the last file loaded."""
    weights_file: Optional[str] = None
    """Basename of the last file loaded (never a path)."""
    damaged: Optional[str] = None
    """Why the weights are not a whole version (a load failed after its checks); None when they are."""
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    beats: bool = True
    """The engine reports its decode steps (HF); False: ``since_progress_s`` is always null (vLLM)."""
    pending: int = 0
    """Generation requests taken and not yet answered."""
    beat_at: float = 0.0
    """``time.monotonic()`` of the engine's last progress, or of the first pending request's arrival."""
    active: int = 0
    loading: bool = False
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def describe(self) -> dict:
        stalled = time.monotonic() - self.beat_at if self.pending and self.beats else None
        return {**self.info, "weights_version": self.weights_version, "weights_file": self.weights_file,
                "damaged": self.damaged, "boot_id": self.boot_id, "pending": self.pending,
                "since_progress_s": stalled}

    def beat(self, _done: int = 0) -> None:
        """The engine's progress callback: it is working, not stuck (any thread)."""
        self.beat_at = time.monotonic()

    def request_taken(self) -> None:
        if not self.pending:
            self.beat_at = time.monotonic()
        self.pending += 1

    def request_done(self) -> None:
        self.pending -= 1

    async def enter(self) -> int:
        """Take a generation lease (waits while a load runs); the weights version it generates with."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self.loading)
            self.active += 1
            return self.weights_version

    async def leave(self) -> None:
        async with self._changed:
            self.active -= 1
            self._changed.notify_all()

    async def exclusive(self, load: Callable[[], Awaitable[None]]) -> None:
        """Run ``load`` with no generation in flight and none starting (loads take turns)."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self.loading)
            self.loading = True
            await self._changed.wait_for(lambda: self.active == 0)
        try:
            await load()
        finally:
            async with self._changed:
                self.loading = False
                self._changed.notify_all()


# -- middleware (pure ASGI: they see every route, vLLM's and ours) -------------------------------------------

async def answer_json(send: Send, status: int, body: dict, headers: Optional[list] = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class KeyCheck:
    """Every request (every path, every method) must carry ``Authorization: Bearer KEY``; else 401."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.digest = app, hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if not (scheme.lower() == "bearer"
                    and secrets.compare_digest(hashlib.sha256(token.strip().encode()).digest(), self.digest)):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await answer_json(send, 401, {"error": "this service needs its key: send the header "
                                                   "'Authorization: Bearer KEY' (the trainer's rollout.remote.api_key, "
                                                   "the service's --api-key or MUGRPO_API_KEY)"},
                              [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads each request body whole before the app sees it, refusing with 413 once it passes ``limit``
    bytes (Content-Length or the bytes actually streamed, whichever shows it first), and with 408 when the
    client sends nothing for ``timeout_s`` before its body is in; then replays it."""

    LINGER_S = 10.0

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float = 30.0):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._refuse(receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                await answer_json(send, 408, {"error": f"the request body did not arrive within {self.timeout_s:g} s "
                                                       "(--header-timeout-s)"}, [(b"connection", b"close")])
                return
            if message["type"] != "http.request":  # the client left before its body was in
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                chunks.clear()
                await self._refuse(receive, send, more)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the real channel: http.disconnect when the client leaves

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Receive, send: Send, more: bool = True) -> None:
        """Answers 413 after discarding what the client still sends (for at most ``LINGER_S``, nothing kept): a
        connection closed on unread bytes is reset, and the reset can destroy the answer before the client
        reads it (a lingering close, as nginx does)."""
        deadline = asyncio.get_running_loop().time() + self.LINGER_S
        while more:
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                break
            more = message["type"] == "http.request" and message.get("more_body", False)
        await answer_json(send, 413, {"error": f"the request body is larger than this service's limit of "
                                           f"{self.limit / 2**20:g} MB (--max-body-mb)"}, [(b"connection", b"close")])


class VersionGate:
    """Generation requests take the gate's lease (see :class:`ServiceState`) and are refused (503) while the
    weights are damaged; the version a request generates with goes into its scope for :class:`VersionHeaders`."""

    def __init__(self, app: ASGIApp, state: ServiceState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GENERATION_PATHS) and scope["path"] != "/health":
            await self.app(scope, receive, send)
            return
        if self.state.damaged:
            await answer_json(send, 503, {"error": f"the service's weights are not a whole version: "
                                                   f"{self.state.damaged}; load a complete version (POST "
                                                   "/load_weights) before generating"})
            return
        if scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        self.state.request_taken()
        try:
            scope["mugrpo_weights_version"] = await self.state.enter()
        except BaseException:
            self.state.request_done()
            raise
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.request_done()
            await self.state.leave()


class VersionHeaders:
    """Every answer (refusals included) gets ``x-mugrpo-weights-version`` (for a generation, the version that
    generated it; else the current one) and ``x-mugrpo-boot-id``."""

    def __init__(self, app: ASGIApp, state: ServiceState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                shown = scope.get("mugrpo_weights_version", self.state.weights_version)
                message = {**message, "headers": [*message.get("headers", []),
                                                  (VERSION_HEADER.encode(), str(shown).encode()),
                                                  (BOOT_HEADER.encode(), self.state.boot_id.encode())]}
            await send(message)

        await self.app(scope, receive, with_headers)


def add_middleware(app: FastAPI, state: ServiceState, security: dict) -> None:
    """The gate innermost, then the body bound, the key check (a request without the key is refused before
    its body is read), and the headers outermost (on every answer). ``security``: ``api_key`` (None: no
    key), ``max_body_bytes``, ``timeout_s`` (for a body to arrive)."""
    app.add_middleware(VersionGate, state=state)
    app.add_middleware(BodyLimit, limit=security["max_body_bytes"], timeout_s=security["timeout_s"])
    if security.get("api_key"):
        app.add_middleware(KeyCheck, key=security["api_key"])
    app.add_middleware(VersionHeaders, state=state)


def header_timeout_protocol(timeout_s: float):
    """uvicorn's HTTP protocol class (httptools where installed, else h11) that closes a connection which
    completes no request's headers for ``timeout_s`` while none of its requests is being served: a client
    that connects and sends nothing, or trickles its headers (slow loris). uvicorn's own
    ``timeout_keep_alive`` only starts after a response, and any byte received cancels it."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class HeaderTimeout(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._watch(None)

        def _watch(self, seen) -> None:
            self.loop.call_later(timeout_s, self._check, seen)

        def _check(self, seen) -> None:
            if self.transport is None or self.transport.is_closing():
                return
            current = self.cycle  # uvicorn 0.55: a new cycle once a request's headers are in
            if current is seen and (current is None or current.response_complete):
                self.transport.close()
                return
            self._watch(current)

    return HeaderTimeout


# -- errors: the client's mistakes, named ---------------------------------------------------------------------

class BadRequest(Exception):
    """A client's mistake: answered 400 with the message (which names the field)."""


def parse_body(model: type[BaseModel], raw: bytes):
    """``model`` validated from the raw JSON body (whatever the Content-Type); BadRequest naming each field
    that is wrong, or saying why the body is not JSON (e.g. nested too deep)."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise BadRequest(f"bad request: {field_errors(exc)}") from None


def field_errors(exc) -> str:
    """'field: what is wrong' for each of a pydantic validation's errors (the body's own name left out)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg')}" + (f" (got {err['input']!r:.60})" if "input" in err and
                                                      not isinstance(err["input"], (dict, list)) else ""))
    return "; ".join(parts)


def add_error_handlers(app: FastAPI, validation: bool = True) -> None:
    """400 / 4xx / 500 answers for the errors above; ``validation``: FastAPI's own request validation too
    (False on vLLM's app, whose handlers answer its routes in its own format)."""
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": f"bad request: {field_errors(exc)}"}, status_code=400)

    async def refused(_request: Request, exc: WeightsRefused) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    async def bad(_request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    async def failed(_request: Request, exc: LoadFailed) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=500)

    if validation:
        app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(WeightsRefused, refused)
    app.add_exception_handler(LoadFailed, failed)
    app.add_exception_handler(BadRequest, bad)


# -- mugrpo's routes -------------------------------------------------------------------------------------------

class LoadWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(min_length=1, max_length=4096)
    """A safetensors file (or a folder of them) inside the service's --weights-dir."""
    version: int = Field(ge=1, le=2**53)
    """The version number it reports from then on; must be above the current one."""


Loader = Callable[[list, int], Awaitable[None]]
"""``await loader(files, version)``: check and load the files. Raises :class:`WeightsRefused` when nothing
changed, the error of :func:`damaged_on_failure` when something may have."""


def mugrpo_router(state: ServiceState, loader: Loader) -> APIRouter:
    router = APIRouter()

    @router.get("/info")
    async def info() -> dict:
        return state.describe()

    @router.post("/load_weights")
    async def load_weights(request: Request) -> dict:
        body = parse_body(LoadWeightsRequest, await request.body())
        files = files_inside(state.weights_dir, body.path)  # before anything is opened

        async def load() -> None:
            if body.version <= state.weights_version:
                raise WeightsRefused(409, f"load_weights: version {body.version} is not above the service's "
                                          f"current version {state.weights_version}; versions never go back")
            await loader(files, body.version)
            state.weights_version, state.weights_file, state.damaged = body.version, files[0].name, None

        await state.exclusive(load)
        log(f"loaded weights version {body.version} from {files[0].name}")
        return {"weights_version": state.weights_version, "boot_id": state.boot_id}

    return router


class LoadFailed(Exception):
    """A load that failed after its checks passed, while parameters were changing: the weights are no
    whole version (answered 500; the state is marked damaged, so generation answers 503)."""


def damaged_on_failure(state: ServiceState, what: str, exc: BaseException) -> LoadFailed:
    """Record that a load failed midway (the model may be half-updated); the error to raise."""
    state.damaged = f"loading {what} failed midway ({type(exc).__name__}: {exc})"
    log(f"error: {state.damaged}; generation is refused (503) until a complete version loads")
    return LoadFailed(state.damaged)

