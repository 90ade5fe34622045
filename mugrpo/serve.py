"""``mugrpo serve``: start a rollout service (:mod:`mugrpo.rollout.service`) that trainers with
``rollout.engine=remote`` generate with (docs/SERVING.md).

The port is bound before the model loads, so a port in use fails at once (exit 2, naming ``--port``).
Progress lines go to stderr; the line ``[mugrpo serve] listening on http://HOST:PORT`` says the service
answers (with ``--port 0`` it names the free port chosen).
"""

from __future__ import annotations

import argparse
import errno
import os

from mugrpo.errors import ConfigError

ENGINE_KINDS = ("hf", "vllm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model id, local folder, or smollm2-135m-instruct: the "
                                                  "trainer's model.name (its weights are replaced at every sync)")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: any free port, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface; "
                                                       "the service has no authentication, see docs/SERVING.md)")
    p.add_argument("--engine", choices=ENGINE_KINDS, default="vllm", help="the in-process engine (default vllm)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="engine weights' dtype: the trainer's resolved rollout.dtype (checked at its start)")
    p.add_argument("--batch-size", type=int, default=64, help="HF engine: sequences per generate call when the "
                                                              "trainer does not send its rollout.batch_size")
    p.add_argument("--seed", type=int, default=0, help="the engine's seed (requests carry their own seeds)")
    p.add_argument("--kv-cache-gb", type=float, default=2.0,
                   help="vLLM on CPU: KV cache size (rollout.vllm.kv_cache_gb)")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM: prompt + response limit")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM on GPU: memory fraction")
    p.add_argument("--cache-dir", default="~/.cache/mugrpo", help="where built-in models are converted to")


def run(args) -> int:
    from mugrpo.rollout.service import make_server  # http.server and the wire format: no torch yet

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port is 0..65535 (0: any free port)")
    try:
        server = make_server(None, args.host, args.port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {args.port}: the address {args.host}:{args.port} is already in use (another "
                              "service?); choose another --port, or --port 0 for any free one") from exc
        raise ConfigError(f"--host {args.host} --port {args.port}: cannot listen there ({exc})") from exc
    import mugrpo
    from mugrpo.config.rollout_sections import RolloutConfig, VllmConfig
    from mugrpo.models.loading import load_tokenizer, resolve_model_path
    from mugrpo.rollout.engines import make_engine
    from mugrpo.rollout.service import ServiceState, log, model_fingerprint, tokenizer_fingerprint

    try:
        path = resolve_model_path(args.model, os.environ.get("MUGRPO_CACHE", args.cache_dir))
        tokenizer = load_tokenizer(path)
        cfg = RolloutConfig(engine=args.engine, dtype=args.dtype, batch_size=args.batch_size,
                            vllm=VllmConfig(kv_cache_gb=args.kv_cache_gb, max_model_len=args.max_model_len,
                                            gpu_memory_utilization=args.gpu_memory_utilization))
        cfg.validate()
        log(f"loading {args.model} ({path}) into the {args.engine} engine, {args.dtype}")
        engine = make_engine(args.engine, path, tokenizer, cfg, seed=args.seed)
        info = {"model": args.model, "model_path": path, "model_fingerprint": model_fingerprint(path),
                "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "engine": args.engine,
                "dtype": args.dtype, "mugrpo_version": mugrpo.__version__}
        server.RequestHandlerClass.state = ServiceState(engine, info, vocab_size=len(tokenizer))
        host, port = server.server_address[:2]
        log(f"listening on http://{host}:{port}")
        try:
            server.serve_forever(poll_interval=0.2)
        except KeyboardInterrupt:
            log("stopped")
    finally:
        server.server_close()
    return 0
