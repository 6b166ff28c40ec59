"""The ``clawstream`` command line: one entry point for every service and tool.

Run ``clawstream --help`` (or ``python -m clawstream --help``) for the list of commands. The commands by family:
``local`` (kafka, topics, model, vllm, harness), ``tasks``, ``runs`` (demo, eval, demo-seeds, chaos) and
``services`` (the pass-through service commands, generated from one table); ``base`` holds what they share. Stage
modules are imported inside the commands, so ``clawstream --help`` stays fast.
"""

from __future__ import annotations

import click

from clawstream import __version__
from clawstream.cli import local, runs, services, tasks
from clawstream.cli.base import Group


@click.group(cls=Group)
@click.version_option(__version__, prog_name="clawstream")
def main() -> None:
    """clawstream: RL of an LLM policy through real agent harnesses, over Apache Kafka."""


for _command in (
    local.kafka,
    local.registry,
    local.topics,
    local.model,
    local.vllm,
    local.harness,
    tasks.tasks,
    runs.demo,
    runs.eval_command,
    runs.demo_seeds,
    runs.chaos,
):
    main.add_command(_command)
for _service in services.SERVICES:
    _parent = main if _service.group is None else main.commands[_service.group]
    assert isinstance(_parent, click.Group), _service.group
    _parent.add_command(services.service_command(_service))
