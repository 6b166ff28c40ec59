"""The pass-through service commands, generated from one table: ``clawstream NAME ARGS...`` runs the service's own
``main(ARGS)`` and exits with its status.

Each service parses its own arguments (``clawstream NAME --help`` shows its parser's help), so these commands take
every argument unparsed. The service module is imported when the command runs, so ``clawstream --help`` stays fast.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import click

PASSTHROUGH: dict[str, Any] = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@dataclass(frozen=True)
class Service:
    """One row of :data:`SERVICES`."""

    name: str  # the command name
    entry: str  # ``module:function``: the service's main, called with the command's arguments
    help: str  # the command's help text
    group: str | None = None  # the command group it belongs to (None: top level)
    default_args: tuple[str, ...] = ()  # what runs when no argument is given


SERVICES: tuple[Service, ...] = (
    Service(
        "proxy",
        "producers.proxy.app:main",
        "Serving proxy: harness API dialects in, engine calls out, call events to Kafka (producers/proxy/app.py).",
    ),
    Service(
        "infer",
        "consumers.inference.server:main",
        "Inference engine: vLLM's completions protocol on CPU, weight versions applied live (consumers/).",
    ),
    Service(
        "learner",
        "learner.train:main",
        "Learner: sealed batches in, GRPO + TIS step, weight versions out, exactly once (learner/train.py).",
    ),
    Service(
        "learner-ranks",
        "learner.train_ranks:main",
        "The learner on N data-parallel ranks (--nproc-per-node N; the rest as `learner`): rank 0 owns Kafka\n"
        "(learner/train_ranks.py).",
    ),
    Service(
        "streams",
        "streams.app:main",
        "Faust stream processors: calls + events + rewards → trajectories → GRPO groups → batches (`streams worker`).",
        default_args=("worker",),
    ),
    Service(
        "sandbox-worker",
        "producers.sandbox.worker:main",
        "Sandbox worker: rollout requests in, harness runs in sandboxes, lifecycle + reward events out.",
    ),
    Service(
        "schedule",
        "producers.scheduler.service:main",
        "Scheduler: per step, tasks x rollouts per group x harness mix → rollout requests (--eval: score table).",
    ),
    Service(
        "sft",
        "warmstart.sft_topics:model_sft",
        "SFT warm start on synthetic agent demonstrations of the CPU task suite (warmstart/sft.py; --help for\n"
        "options), or on a topic prefix's recorded trajectories (--from-topics PREFIX; warmstart/sft_topics.py).",
        group="model",
    ),
    Service(
        "curriculum",
        "warmstart.curriculum:main",
        "Per-family greedy and sampled solve rates of a model on the CPU suite's training tasks, and the curriculum\n"
        "spec they give (FAMILY=WEIGHT,...: clawstream demo --curriculum; warmstart/curriculum.py).",
        group="model",
    ),
    Service(
        "demos",
        "warmstart.record:main",
        "Record demonstrations: the scripted teacher solves built-in CPU tasks through a real harness (opencode,\n"
        "codex, qwen-code), captured on a topic prefix by the path RL uses (warmstart/record.py).",
        group="model",
    ),
    Service(
        "probe",
        "warmstart.copy_probe:main",
        "Teacher-forced probe of a policy's first call through a real harness's recorded prompt: does it copy the\n"
        "task's file names? (held-out tasks; warmstart/copy_probe.py).",
        group="model",
    ),
    Service(
        "tail",
        "consumers.analytics.tail:main",
        "A topic's records as decoded JSON lines: last N, --from-beginning, --offset, --since; --rollout, --follow.",
    ),
    Service(
        "export",
        "consumers.analytics.export:main",
        "A topic's records over an offset or time range to JSON lines or Parquet (--format jsonl|parquet --out PATH).",
    ),
    Service(
        "audit",
        "consumers.analytics.audit:main",
        "Read a run's topics back: anything lost, doubled or trained twice? (exit 0 clean, 1 not; --json).",
    ),
    Service(
        "lag",
        "consumers.analytics.lag:main",
        "Consumer lag per group and partition of a run's topics: committed vs last stable offset (--watch, --json).",
    ),
    Service(
        "dashboard",
        "consumers.analytics.dashboard.server:main",
        "Live dashboard over the topics: rewards, statuses, trees, throughput, lag, weights, capture health (--help).",
    ),
    Service(
        "health",
        "consumers.analytics.dashboard.health_report:main",
        "Capture health per harness and chat template over a range of the calls topic (--help for the range).",
    ),
    Service(
        "track",
        "consumers.tracker.consumer:main",
        "Follow a run's topics into one MLflow run: params, per-step metrics, weight versions, sampled trajectories\n"
        "(--mlflow URI --prefix P; consumers/tracker; needs the 'track' extra).",
    ),
    Service(
        "replay",
        "consumers.analytics.replay:main",
        "Replay a topic range (offsets or times) into a new topic prefix, e.g. a run's batches into a fresh learner\n"
        "(consumers/analytics/replay.py; docs/replay.md; --help for options).",
    ),
)


def service_main(entry: str) -> Callable[[Sequence[str]], Any]:
    """``module:function`` → the function (importing its module now)."""
    module, _, function = entry.partition(":")
    run: Callable[[Sequence[str]], Any] = getattr(importlib.import_module(module), function)
    return run


def service_command(service: Service) -> click.Command:
    """The click command that hands its arguments to the service's main and exits with what it returns."""

    def run(ctx: click.Context) -> None:
        sys.exit(service_main(service.entry)(ctx.args or list(service.default_args)))

    return click.Command(
        service.name, callback=click.pass_context(run), help=service.help, context_settings=PASSTHROUGH
    )
