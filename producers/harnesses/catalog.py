"""Every harness adapter by name: the built-in files (``ADAPTERS``) and the ones a user added.

``ADAPTERS[name]`` → :class:`HarnessAdapter`, read from ``producers/harnesses/adapters/*.toml`` (package data; one
file per harness: the single source of the launch, the install pin and the teacher's recorded version).
``all_adapters()`` adds the files in ``$CLAWSTREAM_HOME/harnesses/adapters/`` (``clawstream harness add FILE``) and
any ``extra_files`` (``--harness-file FILE``); a user file may not reuse a built-in name. ``resolve(NAME|FILE)``
is what a command that takes a harness does.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from clawbase.settings import clawstream_home
from producers.harnesses.adapter_file import AdapterFileError, load_adapter
from producers.harnesses.base import HarnessAdapter

BUILTIN_DIR = Path(__file__).resolve().parent / "adapters"


def user_dir(home: Path | None = None) -> Path:
    """Where ``clawstream harness add`` copies adapter files."""
    return (home or clawstream_home()) / "harnesses" / "adapters"


def _load_dir(directory: Path) -> dict[str, HarnessAdapter]:
    out: dict[str, HarnessAdapter] = {}
    for path in sorted(directory.glob("*.toml")):
        adapter = load_adapter(path)
        if adapter.name != path.stem:
            raise AdapterFileError(f"{path}: name = {adapter.name!r} but the file is {path.name}; rename one of them")
        out[adapter.name] = adapter
    return out


ADAPTERS: dict[str, HarnessAdapter] = _load_dir(BUILTIN_DIR)


def _add(into: dict[str, HarnessAdapter], adapter: HarnessAdapter, where: str) -> None:
    if adapter.name in ADAPTERS:
        raise AdapterFileError(f"{where}: name = {adapter.name!r} is a built-in harness; pick another name")
    into[adapter.name] = adapter


def all_adapters(home: Path | None = None, extra_files: Iterable[str | Path] = ()) -> dict[str, HarnessAdapter]:
    """The built-in adapters, the user's (``$CLAWSTREAM_HOME/harnesses/adapters``) and ``extra_files``."""
    out = dict(ADAPTERS)
    directory = user_dir(home)
    if directory.is_dir():
        for name, adapter in _load_dir(directory).items():
            _add(out, adapter, str(directory / f"{name}.toml"))
    for path in extra_files:
        _add(out, load_adapter(path), str(path))
    return out


def resolve(name_or_file: str, home: Path | None = None) -> HarnessAdapter:
    """A harness by name (built in or added) or an adapter file's path (anything ending in ``.toml``)."""
    if name_or_file.endswith(".toml") or "/" in name_or_file:
        return load_adapter(name_or_file)
    adapters = all_adapters(home)
    if name_or_file not in adapters:
        raise AdapterFileError(
            f"unknown harness {name_or_file!r}; known: {', '.join(sorted(adapters))} "
            "(or pass an adapter file: clawstream harness add FILE)"
        )
    return adapters[name_or_file]
