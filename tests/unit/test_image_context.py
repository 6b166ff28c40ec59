"""The images' build context (.dockerignore, a whitelist) lets in every package the distribution ships: a package
left out builds an image whose `import` fails (it happened when clawbase/ and warmstart/ were added)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_shipped_package_is_in_the_build_context() -> None:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(p.rstrip("*") for p in include)
    allowed = {line[1:].strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert [p for p in packages if p not in allowed] == []
    assert all((ROOT / p / "__init__.py").exists() for p in packages)
