"""``mugrpo serve``'s command line: its flags, the checks made before anything loads (port, host and key,
bounds), the socket bound first, the dtype by the trainer's rule, the KV cache size; then the engine's
service (:mod:`mugrpo.serve.hf_app` or :mod:`mugrpo.serve.vllm_app`)."""

from __future__ import annotations

import argparse
import errno
import os
import socket
from typing import Optional

from mugrpo.errors import ConfigError

ENGINE_KINDS = ("hf", "vllm")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
KEY_ENV = "MUGRPO_API_KEY"
KV_CACHE_CAP_GB = 1.0
"""``--kv-cache-gb auto`` takes at most this much (vLLM on CPU preallocates the whole cache)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model id, local folder, or smollm2-135m-instruct: the "
                                                  "trainer's model.name (its weights are replaced at every sync)")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: any free port, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other, "
                                                       "e.g. 0.0.0.0, needs --api-key)")
    p.add_argument("--engine", choices=ENGINE_KINDS, default="vllm", help="the serving engine (default vllm)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights' dtype; auto: the trainer's rollout.dtype=auto rule (bfloat16 where the machine "
                        "computes bf16 natively, else float32)")
    p.add_argument("--api-key", default=None, help=f"the key every request must send (Authorization: Bearer KEY); "
                                                   f"default: ${KEY_ENV}; the trainer's rollout.remote.api_key")
    p.add_argument("--weights-dir", default=None, help="the only folder weights are loaded from (default: the "
                                                       "trainer's default rollout.remote.weights_dir)")
    p.add_argument("--batch-size", type=int, default=64, help="HF engine: sequences per generate call when the "
                                                              "trainer does not send its rollout.batch_size")
    p.add_argument("--seed", type=int, default=0, help="the engine's seed (requests carry their own seeds)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + response limit (default: the model's, at most 4096)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="vLLM: sequences generated at once")
    p.add_argument("--kv-cache-gb", default="auto", help="vLLM on CPU: KV cache size; auto: --max-num-seqs x "
                                                         f"--max-model-len tokens, at most {KV_CACHE_CAP_GB:g} GB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM on GPU: memory fraction")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted (413 above)")
    p.add_argument("--max-n", type=int, default=256, help="most samples per prompt (n) in one request")
    p.add_argument("--max-seqs", type=int, default=4096, help="most sequences (prompts x n) in one request")
    p.add_argument("--header-timeout-s", type=float, default=30.0, help="a connection that completes no request's "
                                                                       "headers this long while idle is closed")
    p.add_argument("--served-model-name", default=None, help="the model's name in /v1/models and /info (default: "
                                                             "--model, or a local folder's last part: no paths)")
    p.add_argument("--cache-dir", default="~/.cache/mugrpo", help="where built-in models are converted to")


def check_start(args) -> Optional[str]:
    """The checks made before anything loads (ConfigError naming the flag); the API key in effect."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port is 0..65535 (0: any free port)")
    for flag, value in (("--header-timeout-s", args.header_timeout_s), ("--max-body-mb", args.max_body_mb),
                        ("--max-n", args.max_n), ("--max-seqs", args.max_seqs), ("--batch-size", args.batch_size),
                        ("--max-num-seqs", args.max_num_seqs)):
        if not value > 0:
            raise ConfigError(f"{flag} {value}: must be > 0")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ConfigError(f"--max-model-len {args.max_model_len}: must be >= 2 (a prompt token and a new one)")
    key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV) or None
    if key is not None and not key.strip():
        raise ConfigError("--api-key is empty; give a key, or leave it out on a loopback --host")
    if key is None and args.host not in LOOPBACK:
        raise ConfigError(f"--host {args.host} listens beyond this machine, and the service has no key: set "
                          f"--api-key KEY (or {KEY_ENV}) and give the trainer rollout.remote.api_key, or serve on "
                          "--host 127.0.0.1")
    if args.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("--engine vllm needs vLLM, which this Python does not have: run the service with "
                              "the vLLM environment (.venv-vllm/bin/python -m mugrpo serve ...; bash "
                              "scripts/setup_vllm.sh installs it), or use --engine hf")
    if args.kv_cache_gb != "auto":
        try:
            if not float(args.kv_cache_gb) > 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--kv-cache-gb {args.kv_cache_gb}: a size in GB > 0, or auto") from None
    return key


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port), or ConfigError naming ``--port`` / ``--host``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on the same port at once
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: the address {host}:{port} is already in use (another service?); "
                              "choose another --port, or --port 0 for any free one") from exc
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc})") from exc
    return sock


def kv_cache_bytes(per_token_bytes: int, max_num_seqs: int, max_model_len: int, cap_bytes: int) -> int:
    """KV cache for ``max_num_seqs`` sequences of ``max_model_len`` tokens, at most ``cap_bytes`` but never
    below one whole sequence (vLLM refuses a cache that cannot hold one)."""
    return max(per_token_bytes * max_model_len, min(cap_bytes, per_token_bytes * max_num_seqs * max_model_len))


def kv_bytes_per_token(config, dtype: str) -> int:
    """Bytes of K and V per token over all layers for an HF config in ``dtype``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def resolve_dtype(dtype: str) -> str:
    """``auto``: the trainer's rule (train.autocast=auto, rollout.dtype=auto), on this machine."""
    if dtype != "auto":
        return dtype
    from mugrpo.hardware import detect, resolve

    return resolve("auto", "auto", "hf", detect()).engine_dtype


def served_name(args) -> str:
    """``--served-model-name``, else ``--model`` unless it is a local path (the folder's name then)."""
    if args.served_model_name:
        return args.served_model_name
    return os.path.basename(os.path.normpath(args.model)) if os.path.exists(args.model) else args.model


def run(args) -> int:
    key = check_start(args)
    sock = bind(args.host, args.port)
    try:
        import mugrpo
        from mugrpo.models.loading import load_tokenizer, resolve_model_path
        from mugrpo.rollout.service import default_weights_dir, model_fingerprint, tokenizer_fingerprint
        from mugrpo.serve.common import ServiceState, log

        path = resolve_model_path(args.model, os.environ.get("MUGRPO_CACHE", args.cache_dir))
        tokenizer = load_tokenizer(path)
        dtype = resolve_dtype(args.dtype)
        weights_dir = os.path.abspath(args.weights_dir or default_weights_dir())
        info = {"model": served_name(args), "model_fingerprint": model_fingerprint(path),
                "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "engine": args.engine, "dtype": dtype,
                "max_model_len": None, "mugrpo_version": mugrpo.__version__}
        state = ServiceState(info, weights_dir)
        log(f"loading {args.model} into the {args.engine} engine, {dtype}"
            + (" (--dtype auto: the trainer's rule on this machine)" if args.dtype == "auto" else ""))
        security = {"api_key": key, "max_body_bytes": int(args.max_body_mb * 2**20),
                    "timeout_s": args.header_timeout_s}
        if args.engine == "hf":
            from mugrpo.serve.hf_app import serve_hf

            serve_hf(args, path, tokenizer, state, security, sock)
        else:
            from mugrpo.serve.vllm_app import serve_vllm

            serve_vllm(args, path, state, security, sock)
    finally:
        sock.close()
    return 0
