"""A CPU inference worker run as a real subprocess (``python -m consumers.inference.server --port 0``) for tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    """A worker subprocess; its stdout/stderr is collected for failure messages."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "consumers.inference.server", "--port", "0", *args],
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(90) or self.url is None:
            self.stop()
            raise AssertionError("worker did not start:\n" + self.log())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = re.search(r"on (http://\S+:\d+)$", line.strip())
            if match and self.url is None:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
