"""A learned logit scale: one scalar the policy gradient trains with its own learning rate (a departure from the paper).

Why (measured, bench/results/quickstart.md): on the CPU suite the warm start solves far more held-out tasks greedily
than at the sampling temperature RL trains and is evaluated with (0.77 vs 0.62 mean reward, 128 tasks; 0.76 at
temperature 0.5), so the largest thing RL can learn in a few hundred rollouts is to be more decisive. The GRPO gradient
does point that way, consistently, but spread over 3.7M weights that AdamW each moves by about ``lr`` per step, a
batch of 32-64 rollouts cannot move the policy's sharpness before the noise in every other direction does harm (nine
probes, lr 5e-5 to 1e-3). Here that one direction gets its own parameter: ``s``, with logits = W · (exp(s) · norm(h))
(the final RMSNorm's output scaled by exp(s), i.e. a temperature of exp(-s) built into the policy), trained by the same
loss as every other weight, with ``Hyperparams.logit_scale_lr``. Its gradient is the batch's covariance of reward and
Σ_t (logit of the sampled token − the expected logit): positive when the rollouts that sampled the model's likelier
tokens earned more, negative when the better rollouts took less likely tokens (so it does not collapse to greedy where
greedy is wrong).

After every training step :meth:`LogitScale.fold` multiplies ``exp(s)`` into the final norm's gain and resets ``s``
to 0: the logits stay exactly the same, and the published weights remain a plain Qwen3 that any engine (the CPU engine,
vLLM) serves unchanged, and that a resumed learner loads without knowing about ``s``.

Pure torch: no Kafka. Used by ``learner.train`` (the service) and its tests.
"""

from __future__ import annotations

import torch

from clawbase.errors import ConfigError


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder's last RMSNorm (its output feeds the LM head), e.g. ``model.model.norm`` of a Qwen3ForCausalLM."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module) or getattr(norm, "weight", None) is None:
        raise ConfigError(
            f"logit_scale_lr > 0 needs a decoder with a final norm that has a gain (model.model.norm.weight); "
            f"{type(model).__name__} has none: set logit_scale_lr=0"
        )
    return norm


class LogitScale:
    """``s`` (log of the factor on the final norm's output), hooked into ``model``'s forward (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.norm = final_norm(model)
        weight = self.norm.weight
        self.log_scale = torch.nn.Parameter(torch.zeros((), dtype=torch.float32, device=weight.device))  # ()
        self._hook = self.norm.register_forward_hook(self._scale)
        self.initial_gain = float(weight.detach().float().mean())  # the model's (before a resume loads a version)

    def _scale(self, _module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        return output * self.log_scale.exp().to(output.dtype)  # (B, T, H)

    @property
    def factor(self) -> float:
        return float(self.log_scale.detach().exp())

    def relative_gain(self) -> float:
        """Mean gain of the final norm now (exp(s) included) over the initial model's: ≈ 1/temperature, relatively."""
        return float(self.norm.weight.detach().float().mean()) * self.factor / self.initial_gain

    @torch.no_grad()
    def fold(self) -> float:
        """Move ``exp(s)`` into the norm's gain and set ``s`` to 0 (same logits); returns the factor folded."""
        factor = self.log_scale.exp()
        self.norm.weight.mul_(factor.to(self.norm.weight.dtype))
        self.log_scale.zero_()
        return float(factor)

    def remove(self) -> None:
        """Unhook (after a last :meth:`fold`, the model computes exactly what it did with the hook)."""
        self._hook.remove()
