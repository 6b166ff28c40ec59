"""The layer rule is enforced by a tool, not by review: import-linter checks the contracts in pyproject.toml
(layers only point down, no import circles between sibling modules or packages, no `unittest` in shipped code)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = (
    "Layers only point down",
    "No import circles between sibling modules or packages",
    "No test doubles in shipped code",
)


def test_import_contracts_hold(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from importlinter.cli import lint_imports

    monkeypatch.chdir(ROOT)
    status = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    for contract in CONTRACTS:
        assert f"{contract} KEPT" in report, report[-4000:]
    assert status == 0, report[-4000:]
