"""Per-rollout quotas of the serving proxy (pure): model calls, and prompt tokens summed over the rollout's calls.

A call is *admitted* (:meth:`Usage.admit`) after its prompt is rendered and before the engine is called; it counts
then, whatever the engine answers. A call that would take the rollout past either quota is refused instead: the
harness gets :data:`QUOTA_STATUS` in its dialect naming the quota, the engine is not called, no call event is
published, and the rollout is flagged (``Rollout.quota_exceeded``), so its seal reports ``status: quota_exceeded``.
That is the policy's behaviour, not an infrastructure failure: the sandbox worker grades the rollout as usual and
records the flag in its lifecycle event's ``reason`` (docs/method.md#the-proxys-http-interface).
A call refused for what the rollout sent (bad JSON, past a request limit, a prompt too long: any 4xx but 401 and
a quota's own) counts as a call too (:meth:`Usage.count_refused`): refusing is work the rollout made the proxy do.

The status is 400 (invalid_request_error), not 429: the SDKs behind the harnesses retry 429 with backoff (Claude
Code up to ten times), which would hold a rollout that can never be served again until its wall-clock limit.
"""

from __future__ import annotations

from dataclasses import dataclass

QUOTA_STATUS = 400
QUOTA_STATUS_NAME = "quota_exceeded"  # the seal's status of a rollout refused a call by a quota


@dataclass(frozen=True)
class Quotas:
    """The limits of one rollout; 0 = unlimited."""

    max_calls: int = 256
    max_prompt_tokens: int = 20_000_000  # summed over the rollout's calls (a cached prefix counts each time)

    def __post_init__(self) -> None:
        if self.max_calls < 0 or self.max_prompt_tokens < 0:
            raise ValueError(f"quotas must be >= 0 (0 = unlimited), got {self}")


@dataclass
class Usage:
    """What one rollout has been admitted so far."""

    calls: int = 0
    prompt_tokens: int = 0

    def calls_left(self, quotas: Quotas) -> str | None:
        """Why one more call cannot be admitted by the call quota (checked before the body is read), or None."""
        if quotas.max_calls and self.calls >= quotas.max_calls:
            return f"rollout quota exceeded: max_calls_per_rollout {quotas.max_calls} calls already made"
        return None

    def count_refused(self) -> None:
        """A call refused for what the rollout sent (not by a quota): one more call, no prompt tokens."""
        self.calls += 1

    def admit(self, quotas: Quotas, prompt_tokens: int) -> str | None:
        """Count a call of ``prompt_tokens`` and return None, or return why it is refused (and count nothing)."""
        refused = self.calls_left(quotas)
        if refused is not None:
            return refused
        total = self.prompt_tokens + prompt_tokens
        if quotas.max_prompt_tokens and total > quotas.max_prompt_tokens:
            return (
                f"rollout quota exceeded: max_prompt_tokens_per_rollout {quotas.max_prompt_tokens} (this call's "
                f"{prompt_tokens} prompt tokens on top of {self.prompt_tokens} already sent)"
            )
        self.calls += 1
        self.prompt_tokens = total
        return None
