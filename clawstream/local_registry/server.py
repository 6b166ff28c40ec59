"""A local Apicurio Registry serving the Confluent REST API (``/apis/ccompat/v7``) for the registry wire format.

Provision: Apicurio's server module is published on Maven Central as a plain jar, so the recipe
``compose/schema-registry/pom.xml`` depends on it and re-runs Quarkus' build (``mvn package``), once, into
``$CLAWSTREAM_HOME/registry-<pom hash>`` (editing the pom re-provisions; a file lock serialises provisioners). Start:
one JVM in its own session, its pid, port and URL in ``<home>/state.json``, ready when ``GET /subjects`` answers;
stop: by that pid. Storage is in memory: a restarted registry starts empty (``topics create`` registers again).
Run: ``clawstream registry up [--port N] | down | status`` (prints the URL for CLAWSTREAM_SCHEMA_REGISTRY_URL).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from clawbase.errors import KafkaLocalError
from clawbase.kafka.local_state import pid_alive
from clawbase.settings import clawstream_home
from clawstream.local_kafka.node import stop_pids
from clawstream.local_kafka.provision import file_lock, find_java

RECIPE_DIR = Path(__file__).resolve().parents[2] / "compose" / "schema-registry"
API = "/apis/ccompat/v7"
DEFAULT_PORT = 8081


def build_dir(cache: Path) -> Path:
    """The cached application for the recipe's pom (keyed by the pom's hash)."""
    digest = hashlib.sha256((RECIPE_DIR / "pom.xml").read_bytes()).hexdigest()[:12]
    return cache / f"registry-{digest}"


def provision(cache: Path | None = None, *, quiet: bool = False) -> Path:
    """Build the registry once with Maven and return the runnable jar (``app/*-runner.jar``, its ``lib/`` beside)."""
    root = build_dir(cache or clawstream_home())
    done = root / "complete"
    if not done.exists():
        with file_lock(root / ".lock"):
            if not done.exists():
                _build(root, quiet)
                done.write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
    return next((root / "app").glob("*-runner.jar"))


def _build(root: Path, quiet: bool) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaLocalError("Maven is needed once to build the schema registry and `mvn` is not on PATH; install it")
    if not quiet:
        print(f"building the schema registry with Maven into {root} (once) ...", file=sys.stderr, flush=True)
    work = root / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copy(RECIPE_DIR / "pom.xml", work / "pom.xml")
    proc = subprocess.run(
        [mvn, "-B", "-q", "-f", str(work / "pom.xml"), "package", "-DskipTests"],
        capture_output=True,
        text=True,
        check=False,
    )
    target = work / "target"
    if proc.returncode != 0 or not any(target.glob("*-runner.jar")):
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise KafkaLocalError("Maven could not build the schema registry:\n  " + "\n  ".join(tail))
    app = root / "app"
    shutil.rmtree(app, ignore_errors=True)
    app.mkdir()
    for item in [*target.glob("*-runner.jar"), target / "lib"]:
        item.replace(app / item.name)
    shutil.rmtree(work, ignore_errors=True)


class LocalRegistry:
    """Start, stop and inspect the local registry whose state lives in ``home`` (default
    ``$CLAWSTREAM_HOME/registry``)."""

    def __init__(self, home: Path | None = None, cache: Path | None = None) -> None:
        self.home = home or clawstream_home() / "registry"
        self.cache = cache or clawstream_home()
        self.state_file = self.home / "state.json"
        self.log_file = self.home / "registry.log"

    def state(self) -> dict[str, object] | None:
        try:
            return dict(json.loads(self.state_file.read_text()))
        except (OSError, ValueError):
            return None

    def running_url(self) -> str | None:
        state = self.state()
        return str(state["url"]) if state and pid_alive(int(str(state["pid"]))) else None

    def up(self, port: int = DEFAULT_PORT, *, timeout: float = 120.0, quiet: bool = False) -> str:
        """Start the registry (reusing a running one) and return its Confluent API URL once it answers."""
        url = self.running_url()
        if url:
            return url
        jar, java = provision(self.cache, quiet=quiet), find_java()
        if port == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
        self.home.mkdir(parents=True, exist_ok=True)
        cmd = [java, "-Xmx512m", f"-Dquarkus.http.port={port}", "-Dquarkus.http.host=127.0.0.1", "-jar", str(jar)]
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        url = f"http://127.0.0.1:{port}{API}"
        self.state_file.write_text(json.dumps({"pid": proc.pid, "port": port, "url": url, "started_at": time.time()}))
        if not quiet:
            print(f"starting the schema registry (pid {proc.pid}) on {url} ...", file=sys.stderr, flush=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise KafkaLocalError(f"the schema registry exited ({proc.returncode}); see {self.log_file}")
            try:
                with urllib.request.urlopen(url + "/subjects", timeout=2.0):
                    return url
            except OSError:
                time.sleep(0.5)
        stop_pids([proc.pid], grace=5.0)
        raise KafkaLocalError(f"the schema registry did not answer within {timeout:.0f} s; see {self.log_file}")

    def down(self, *, grace: float = 15.0) -> bool:
        """Stop the registry by its recorded pid. False when none was running."""
        state = self.state()
        if not state or not pid_alive(int(str(state["pid"]))):
            return False
        stop_pids([int(str(state["pid"]))], grace=grace)
        self.state_file.unlink(missing_ok=True)
        return True

    def status(self) -> dict[str, object]:
        state = self.state() or {}
        return {"running": self.running_url() is not None, **state, "log": str(self.log_file)}
