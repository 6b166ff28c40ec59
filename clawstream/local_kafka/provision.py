"""What the local Kafka cluster runs on: a Java 17+ (``JAVA_HOME``, else ``java`` on PATH) and the broker jars,
fetched once from Maven Central through the recipe ``compose/kafka-local/pom.xml`` into a cache keyed by the pom's
hash (editing the pom re-provisions). Concurrent provisioners take a file lock; the jars appear whole or not at all.

Cache: ``$CLAWSTREAM_HOME/jars`` (default ``~/.cache/clawstream/jars``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from clawbase.errors import KafkaLocalError
from clawstream.local_kafka.node import RECIPE_DIR

MIN_JAVA = 17


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created with its parents) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _java_major(java: str) -> int:
    out = subprocess.run([java, "-version"], capture_output=True, text=True, check=False).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not match:
        raise KafkaLocalError(f"could not read the Java version from `{java} -version`: {out.strip()[:200]}")
    major = int(match.group(1))
    return int(match.group(2)) if major == 1 and match.group(2) else major


def find_java() -> str:
    """The ``java`` to run the nodes with: ``JAVA_HOME``'s, else the one on PATH; Java 17+ or a clear error."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise KafkaLocalError(
            f"Java {MIN_JAVA}+ is needed to run the Kafka broker and none was found on PATH or in JAVA_HOME; "
            "install a JDK (e.g. `apt-get install openjdk-17-jre-headless`) and retry"
        )
    major = _java_major(java)
    if major < MIN_JAVA:
        raise KafkaLocalError(f"{java} is Java {major}; Kafka 4.x needs Java {MIN_JAVA}+ (set JAVA_HOME)")
    return java


def lib_dir(jar_cache: Path) -> Path:
    """The cached class path for the recipe's pom (keyed by the pom's hash, so editing the pom re-provisions)."""
    digest = hashlib.sha256((RECIPE_DIR / "pom.xml").read_bytes()).hexdigest()[:12]
    return jar_cache / f"kafka-{digest}" / "lib"


def provision(jar_cache: Path, *, quiet: bool = False) -> Path:
    """Fetch the broker jars once with Maven (into the cache) and return the lib dir."""
    lib = lib_dir(jar_cache)
    done = lib.parent / "complete"
    if done.exists():
        return lib
    with file_lock(lib.parent / ".lock"):
        if done.exists():
            return lib
        mvn = shutil.which("mvn")
        if mvn is None:
            raise KafkaLocalError(
                "Maven is needed once to fetch the Kafka broker jars from Maven Central and `mvn` is not on "
                "PATH; install it (e.g. `apt-get install maven`) and retry"
            )
        if not quiet:
            print(f"provisioning Kafka jars with Maven into {lib} (once) ...", file=sys.stderr, flush=True)
        staging = lib.parent / "lib.partial"
        shutil.rmtree(staging, ignore_errors=True)
        cmd = [
            mvn,
            "-B",
            "-q",
            "-f",
            str(RECIPE_DIR / "pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={staging}",
            "-DincludeScope=runtime",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            raise KafkaLocalError("Maven could not fetch the Kafka jars:\n  " + "\n  ".join(tail))
        if not any(staging.glob("kafka_2.13-*.jar")):
            raise KafkaLocalError(f"Maven finished but {staging} holds no kafka_2.13 jar; check {RECIPE_DIR}")
        shutil.rmtree(lib, ignore_errors=True)
        staging.replace(lib)
        done.write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
    return lib
