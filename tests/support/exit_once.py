"""A stand-in service for the stack's restart test: the first run exits with the code given, later runs wait.

``python -m tests.support.exit_once MARKER CODE``: exits CODE if MARKER does not exist yet (creating it), else sleeps
until SIGTERM.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __name__ == "__main__":
    marker, code = Path(sys.argv[1]), int(sys.argv[2])
    if not marker.exists():
        marker.write_text("ran once\n")
        sys.exit(code)
    print("running again", flush=True)
    while True:
        time.sleep(1)
