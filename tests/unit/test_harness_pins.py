"""Harness versions are pinned: npm is asked for ``package@version``, a cache of another version is reinstalled, and
``CLAWSTREAM_HARNESS_VERSIONS`` overrides a pin (or is refused naming the bad entry).

``npm`` here is a shell script on PATH that records its arguments and lays out what ``npm install --prefix`` would:
what is tested is the installer's bookkeeping, not the registry (tests/integration/test_harness_matrix.py installs
the real packages).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from producers.harnesses.install import (
    HARNESSES,
    MARKER,
    HarnessInstallError,
    install_harness,
    installed_spec,
    version_overrides,
)

FAKE_NPM = """#!/bin/sh
# args: install --prefix PREFIX ... SPEC
echo "$@" >> "$NPM_LOG"
prefix=$3
for last; do :; done
mkdir -p "$prefix/node_modules/.bin"
printf '#!/bin/sh\\necho %s\\n' "$last" > "$prefix/node_modules/.bin/opencode"
"""


@pytest.fixture
def fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npm = bin_dir / "npm"
    npm.write_text(FAKE_NPM)
    npm.chmod(npm.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "npm.log"
    monkeypatch.setenv("NPM_LOG", str(log))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CLAWSTREAM_HARNESS_VERSIONS", raising=False)
    return log


def _installs(log: Path) -> list[str]:
    return [line.split()[-1] for line in log.read_text().splitlines()] if log.exists() else []


def test_every_harness_is_pinned_to_an_exact_version() -> None:
    for pkg in HARNESSES.values():
        assert pkg.version[0].isdigit() and pkg.version.count(".") == 2, pkg
        assert pkg.spec == f"{pkg.package}{'==' if pkg.kind == 'pip' else '@'}{pkg.version}"


def test_pinned_version_installed_once_and_another_version_replaced(tmp_path: Path, fake_npm: Path) -> None:
    home = tmp_path / "home"
    pinned = HARNESSES["opencode"].spec
    install_harness("opencode", home=home)
    install_harness("opencode", home=home)  # cached: npm not asked again
    assert _installs(fake_npm) == [pinned]
    assert installed_spec(HARNESSES["opencode"], home / "harnesses") == pinned

    marker = home / "harnesses" / "opencode" / MARKER
    marker.write_text(json.dumps({"package": "opencode-ai"}) + "\n")  # an install from before the pins
    install_harness("opencode", home=home)
    assert _installs(fake_npm) == [pinned, pinned]
    assert json.loads(marker.read_text())["spec"] == pinned


def test_override_installs_the_named_version(tmp_path: Path, fake_npm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    install_harness("opencode", home=home)
    monkeypatch.setenv("CLAWSTREAM_HARNESS_VERSIONS", "opencode=latest, codex=0.1.0")
    install_harness("opencode", home=home)
    assert _installs(fake_npm) == [f"opencode-ai@{HARNESSES['opencode'].version}", "opencode-ai@latest"]


@pytest.mark.parametrize("raw", ["opencode", "opencod=1.0.0", "opencode=", "=1.0"])
def test_a_bad_override_names_the_variable_and_the_form(raw: str) -> None:
    with pytest.raises(HarnessInstallError, match=r"CLAWSTREAM_HARNESS_VERSIONS: bad entry .*name=version"):
        version_overrides(raw)
    assert version_overrides(" opencode=1.2.3 ,, ") == {"opencode": "1.2.3"}


def test_the_teacher_was_recorded_with_the_pinned_versions() -> None:
    from warmstart.teacher import RECORDED_WITH

    assert RECORDED_WITH and all(HARNESSES[name].version == v for name, v in RECORDED_WITH.items())
