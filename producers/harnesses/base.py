"""Harness adapters as data: how to launch one harness against a rollout's proxy base URL and secret.

An adapter is a frozen dataclass (written as a TOML file: ``adapter_file``; the built-in ones in ``adapters/``): the
command line, environment and config files the harness needs, all templated with :class:`string.Template`
(``${name}``; JSON/TOML braces need no escaping) from a :class:`LaunchContext`:

``base_url`` (``{proxy}/r/{rollout}``), ``base_url_v1`` (``.../v1``), ``secret``, ``model``, ``side_model``,
``workspace`` / ``home`` (paths *inside* the sandbox), ``prompt``, ``timeout_s``, ``exe`` (the installed executable
of ``install``), ``python`` (the sandbox's Python) and ``clawstream_root`` (so ``python -m
producers.harnesses.builtin_loop``
imports inside a local sandbox).

A config file path that is relative is relative to the sandbox HOME. The prompt only ever goes into argv (one
element, never through a shell) so no quoting can break it. ``dialect``, ``side_models`` and ``call_kind_notes``
document what the proxy will see (its call-kind rules are proxy-wide: ``CLAWSTREAM_PROXY_SIDE_MODEL_PATTERN``).
Pure: no I/O.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas.events import Dialect


@dataclass(frozen=True)
class ConfigFile:
    path: str  # templated; relative → under the sandbox HOME
    content: str  # templated


@dataclass(frozen=True)
class HarnessAdapter:
    name: str
    description: str
    dialect: Dialect
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    files: tuple[ConfigFile, ...] = ()
    # "npm:package@version" | "pip:package==version" | an executable's path; None: nothing to install (built in).
    install: str | None = None
    bin: str | None = None  # the executable the package provides (default: the package's name)
    node24: bool = False  # needs Node >= 24 first on PATH (OpenClaw)
    model: str = "policy"
    side_models: tuple[str, ...] = ()
    call_kind_notes: str = ""
    # Where under HOME the harness writes its own session transcripts in OpenClaw's format (OpenClaw:
    # ".openclaw/agents", i.e. <agent>/sessions/<id>.jsonl); None: it writes none, so graders that read such a
    # transcript get one built from the conversation the proxy saw (producers.tasks.transcript).
    session_dir: str | None = None
    # Command-line words replaced when the sandbox isolates by itself (a container, the local backend's bubblewrap):
    # a harness's own sandbox may need privileges it withholds (Codex's bubblewrap cannot create namespaces there).
    in_container: Mapping[str, str] = field(default_factory=dict)
    # The version warmstart.teacher's tool calls were recorded with (None: the teacher does not drive it).
    teacher_version: str | None = None


@dataclass(frozen=True)
class LaunchContext:
    base_url: str
    secret: str
    workspace: str
    home: str
    prompt: str
    timeout_s: float
    python: str = "python3"
    contained: bool = False  # the sandbox isolates by itself (``HarnessAdapter.in_container`` applies)
    exe: str = ""
    clawstream_root: str = ""
    model: str = "policy"
    side_model: str = "policy-side"

    def variables(self) -> dict[str, str]:
        base = self.base_url.rstrip("/")
        return {
            "base_url": base,
            "base_url_v1": base + "/v1",
            "secret": self.secret,
            "workspace": self.workspace,
            "home": self.home,
            "prompt": self.prompt,
            "timeout_s": str(int(self.timeout_s)),
            "python": self.python,
            "exe": self.exe,
            "clawstream_root": self.clawstream_root,
            "model": self.model,
            "side_model": self.side_model,
        }


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]  # absolute path inside the sandbox → content


def _sub(template: str, values: Mapping[str, str], where: str) -> str:
    try:
        return string.Template(template).substitute(values)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"bad template in {where}: {exc!r}") from exc


def launch_spec(adapter: HarnessAdapter, ctx: LaunchContext) -> LaunchSpec:
    """The adapter's command, environment and config files for one rollout (pure)."""
    values = {**ctx.variables(), "model": adapter.model if ctx.model == "policy" else ctx.model}
    command = [adapter.in_container.get(part, part) for part in adapter.command] if ctx.contained else adapter.command
    argv = [_sub(part, values, f"{adapter.name} command") for part in command]
    env = {k: _sub(v, values, f"{adapter.name} env {k}") for k, v in adapter.env.items()}
    files = {}
    for f in adapter.files:
        path = _sub(f.path, values, f"{adapter.name} file path")
        if not path.startswith("/"):
            path = f"{ctx.home.rstrip('/')}/{path}"
        files[path] = _sub(f.content, values, f"{adapter.name} file {path}")
    return LaunchSpec(argv, env, files)
