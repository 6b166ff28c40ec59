"""Where tests live: every test under tests/e2e carries the e2e marker, none elsewhere does."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _marks(path: Path) -> str:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            return ast.unparse(node.value)
    return ""


def test_e2e_tests_carry_the_e2e_marker() -> None:
    e2e = sorted((TESTS / "e2e").glob("test_*.py"))
    assert e2e
    assert [p.name for p in e2e if "pytest.mark.e2e" not in _marks(p)] == []


def test_no_test_outside_e2e_claims_to_be_e2e() -> None:
    others = [p for p in TESTS.glob("*/test_*.py") if p.parent.name != "e2e"]
    assert [str(p) for p in others if "pytest.mark.e2e" in _marks(p)] == []
