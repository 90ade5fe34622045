"""The method mugrpo adds to vLLM's worker (``--worker-extension-cls``, vLLM 0.32), so the service's API
process can have the engine core load a weights version by name (``collective_rpc``): tensors cannot cross
into the engine-core process, file names can.

The worker reads every file whole, checks what it read against the spec the API process checked the headers
with (so a file swapped in between is refused too), and only then hands the tensors to vLLM's
``reload_weights`` (which re-runs the loader's post-processing: CPU weights are repacked). A refusal is
returned as a message, with nothing changed; an exception means the reload failed midway.
"""

from __future__ import annotations

from typing import Optional


class ServeWorker:
    def mugrpo_load_files(self, paths: list[str], spec: dict) -> Optional[str]:
        from safetensors.torch import load_file

        from mugrpo.rollout.engines.vllm import _refresh_cpu_lm_heads  # the CPU LM-head repack, vLLM 0.32
        from mugrpo.serve.weights import WeightsRefused, check_tensors

        try:
            tensors = {name: t for p in paths for name, t in load_file(p).items()}
        except Exception as exc:  # noqa: BLE001 - unreadable after all: nothing changed
            return f"load_weights: reading the weights failed ({type(exc).__name__}); nothing was loaded"
        try:
            check_tensors(tensors, spec)
        except WeightsRefused as exc:
            return str(exc)
        self.reload_weights(weights_iterator=list(tensors.items()))
        _refresh_cpu_lm_heads(self)
        return None
