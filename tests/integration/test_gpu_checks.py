"""bench/gpu_checks.py is ready for a GPU machine that has only torch, transformers and numpy: its CPU dry run passes
with every other third-party library this project uses made unimportable (issue #30 item 7)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the GPU checks need torch (the 'ml' extra)")

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("fastavro", "pydantic", "pydantic_settings", "confluent_kafka", "faust", "aiohttp", "orjson", "docker")

# Runs the script as `python -m bench.gpu_checks --dry-run-cpu` behind an import hook that refuses BLOCKED.
RUNNER = f"""
import runpy, sys
BLOCKED = {BLOCKED!r}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"blocked for this test: {{name}}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
sys.argv = ["bench.gpu_checks", "--dry-run-cpu"]
runpy.run_module("bench.gpu_checks", run_name="__main__", alter_sys=True)
"""


def test_the_gpu_checks_dry_run_passes_with_only_torch_and_transformers(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    done = subprocess.run(
        [sys.executable, "-c", RUNNER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    for check in (
        "packed vs per-path logprobs, fp32",
        "learner train_step",
        "learner step, Qwen3-0.6B shape (1 layers)",
    ):
        assert check in done.stdout, out[-4000:]
    assert "FAIL" not in done.stdout, done.stdout
