"""``mugrpo serve``: start a rollout service that trainers with ``rollout.engine=remote`` generate with
(docs/SERVING.md).

- ``--engine vllm``: vLLM's own OpenAI API server, started as vLLM starts it, with mugrpo's routes and
  middleware added to its app (:mod:`mugrpo.serve.vllm_app`).
- ``--engine hf``: a FastAPI app with the same routes over the HF engine (:mod:`mugrpo.serve.hf_app`).

Both: ``--api-key`` (or ``MUGRPO_API_KEY``) guards every route; a ``--host`` other than loopback without a
key exits 2. The dtype resolves by the trainer's rule (``--dtype auto``: bf16 where the CPU or GPU computes
it natively, else float32), so ``mugrpo serve --model M --port P`` and a trainer on ``rollout.dtype=auto``
agree on every machine. Weights load only from ``--weights-dir`` (default: the trainer's default
``rollout.remote.weights_dir``); the service removes nothing there.

The port is bound before the model loads, so a port in use fails at once (exit 2, naming ``--port``).
Progress lines go to stderr; the line ``[mugrpo serve] listening on http://HOST:PORT`` says the service
answers (with ``--port 0`` it names the free port chosen). Ctrl-C or SIGTERM stops it cleanly.
"""

from mugrpo.serve.start import add_arguments, run

__all__ = ["add_arguments", "run"]
