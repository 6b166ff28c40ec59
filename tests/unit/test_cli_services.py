"""The pass-through service commands come from one table (``clawstream.cli.services.SERVICES``): every row names a
module that exists and defines its ``main`` (the module is imported only when the command runs, so neither the CLI's
import nor import-linter sees it), and every row is a command of the CLI that hands its arguments through."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import click

from clawstream.cli import main
from clawstream.cli.services import PASSTHROUGH, SERVICES

STAGES = {"producers", "streams", "consumers", "learner", "warmstart"}


def test_every_entry_names_an_existing_main_of_a_stage() -> None:
    for service in SERVICES:
        module, _, function = service.entry.partition(":")
        assert module.split(".")[0] in STAGES, service
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, service
        tree = ast.parse(Path(spec.origin).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        assert function in defined, service


def test_every_entry_is_a_pass_through_command() -> None:
    for service in SERVICES:
        group = main if service.group is None else main.commands[service.group]
        assert isinstance(group, click.Group)
        command = group.commands[service.name]
        assert command.help == service.help and command.context_settings == PASSTHROUGH, service
