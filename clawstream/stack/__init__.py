"""Run the clawstream services as supervised child processes: the CPU quickstart, evaluations and local experiments.

Modules: ``process`` (``Stack``/``Service``: start, readiness, death, stop; pure process plumbing), ``services`` (how
each service is started, and the broker/topic set-up of a run), ``evaluate`` (``clawstream eval``: a model's held-out
score per harness, greedy and sampled, with standard errors, through the real rollout side of the system).
"""

from clawstream.stack.process import ROOT, Service, Stack, StackError

__all__ = ["ROOT", "Service", "Stack", "StackError"]
