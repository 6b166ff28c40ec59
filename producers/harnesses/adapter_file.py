"""Harness adapter files: a TOML file → a validated :class:`~producers.harnesses.base.HarnessAdapter`.

Every built-in adapter is such a file (``producers/harnesses/adapters/*.toml``, package data) and a user brings
their own the same way (``clawstream harness add FILE`` or ``--harness-file FILE``). The keys are the dataclass's
fields; ``install`` is ``"npm:package@version"``, ``"pip:package==version"`` (a venv per harness in the cache) or a
path to an executable (relative to the file), and ``bin`` names the executable a package provides (default: the
package's name). ``files`` is a list of tables ``{path, content}``; ``env`` and ``in_container`` are tables of
strings. Every string may use the launch templates of ``base`` (``${base_url_v1}``, ``${prompt}`` ...). A bad file
raises :class:`AdapterFileError` naming the file, the key and the fix. Pure: reads the one file it is given.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from clawbase.errors import ClawstreamError
from producers.harnesses.base import ConfigFile, HarnessAdapter, LaunchContext, launch_spec
from schemas.events import Dialect

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
NPM_RE = re.compile(r"^npm:(?P<package>(@[\w.-]+/)?[\w.-]+)@(?P<version>[\w.+-]+)$")
PIP_RE = re.compile(r"^pip:(?P<package>[A-Za-z0-9][\w.-]*(\[[\w,.-]+\])?)==(?P<version>[\w.+!-]+)$")
TEMPLATE_NAMES = "${base_url} ${base_url_v1} ${secret} ${model} ${side_model} ${workspace} ${home} ${prompt} " + (
    "${timeout_s} ${exe} ${python} ${clawstream_root}"
)


class AdapterFileError(ClawstreamError):
    """A harness adapter file is unreadable or invalid; the message names the file, the key and the fix."""


def dialect_of(raw: str) -> Dialect:
    """``openai-chat`` / ``OPENAI_CHAT`` / ``openai_chat`` → :class:`Dialect`; ValueError names the choices."""
    key = raw.strip().upper().replace("-", "_")
    if key not in Dialect.__members__:
        choices = ", ".join(d.lower().replace("_", "-") for d in Dialect.__members__)
        raise ValueError(f"unknown dialect {raw!r}; write one of {choices}")
    return Dialect[key]


def check_install(spec: str) -> str:
    """``npm:package@version`` | ``pip:package==version`` | a path; ValueError says the accepted forms."""
    if spec.startswith(("npm:", "pip:")):
        if not (NPM_RE.match(spec) or PIP_RE.match(spec)):
            raise ValueError(
                f"bad install spec {spec!r}; write 'npm:package@version' (e.g. npm:opencode-ai@1.18.33) or "
                "'pip:package==version' (e.g. pip:aider-chat==0.86.1), pinned to one version"
            )
    elif ":" in spec.split("/", 1)[0] or not spec.strip():
        raise ValueError(f"bad install spec {spec!r}; write npm:package@version, pip:package==version or a path")
    return spec


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str
    content: str


class AdapterModel(BaseModel):
    """The TOML schema: exactly :class:`HarnessAdapter`'s fields (``files`` as tables), nothing else."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str = ""
    dialect: str
    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    files: list[_File] = Field(default_factory=list)
    install: str | None = None
    bin: str | None = None
    node24: bool = False
    model: str = "policy"
    side_models: list[str] = Field(default_factory=list)
    call_kind_notes: str = ""
    session_dir: str | None = None
    in_container: dict[str, str] = Field(default_factory=dict)
    teacher_version: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"bad name {v!r}; lower-case letters, digits, '.', '_', '-' (it names a directory)")
        return v

    @field_validator("dialect")
    @classmethod
    def _dialect(cls, v: str) -> str:
        return dialect_of(v).value

    @field_validator("install")
    @classmethod
    def _install(cls, v: str | None) -> str | None:
        return None if v is None else check_install(v)


def _fix(err: dict[str, Any]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unknown key; the keys are {', '.join(AdapterModel.model_fields)}"
    if kind == "missing":
        return 'missing; add it (command: the argv list, e.g. ["${exe}", "run", "${prompt}"])'
    if kind.endswith("_type") or kind in ("string_type", "list_type", "dict_type", "bool_type", "model_type"):
        return f"wrong type: {err['msg']} (got {type(err.get('input')).__name__})"
    return str(err["msg"]).removeprefix("Value error, ")


def adapter_from_dict(data: dict[str, Any], where: str, base_dir: Path | None = None) -> HarnessAdapter:
    """Validate one parsed adapter table; ``base_dir`` resolves a relative ``install`` path."""
    try:
        m = AdapterModel.model_validate(data)
    except ValidationError as exc:
        lines = [f"{'.'.join(map(str, e['loc'])) or '(file)'}: {_fix(dict(e))}" for e in exc.errors()]
        raise AdapterFileError(f"{where}: invalid harness adapter:\n  " + "\n  ".join(lines)) from exc
    install = m.install
    if install is not None and not install.startswith(("npm:", "pip:")) and base_dir is not None:
        install = str((base_dir / install).resolve())
    adapter = HarnessAdapter(
        name=m.name,
        description=m.description,
        dialect=Dialect(m.dialect),
        command=tuple(m.command),
        env=dict(m.env),
        files=tuple(ConfigFile(f.path, f.content) for f in m.files),
        install=install,
        bin=m.bin,
        node24=m.node24,
        model=m.model,
        side_models=tuple(m.side_models),
        call_kind_notes=m.call_kind_notes,
        session_dir=m.session_dir,
        in_container=dict(m.in_container),
        teacher_version=m.teacher_version,
    )
    try:  # every template resolvable: a typo fails here, not in every rollout
        launch_spec(
            adapter,
            LaunchContext(base_url="http://x/r/x", secret="x", workspace="/w", home="/h", prompt="p", timeout_s=1),
        )
    except ValueError as exc:
        raise AdapterFileError(
            f"{where}: invalid harness adapter: {str(exc).removeprefix('bad template in ' + m.name + ' ')}; "
            f"use $$ for a literal $ and only these templates: {TEMPLATE_NAMES}"
        ) from exc
    return adapter


def load_adapter(path: str | Path) -> HarnessAdapter:
    """Read and validate one adapter file (TOML)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise AdapterFileError(f"{path}: cannot read the harness adapter file: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise AdapterFileError(f"{path}: not valid TOML ({exc}); fix the syntax (https://toml.io)") from exc
    return adapter_from_dict(data, str(path), path.parent)
