"""The learner's weight store over HTTP, so engines on other hosts need no shared filesystem.

Read-only: GET and HEAD of ``/<model>/v<version:06d>[-<attempt>]/model.safetensors`` (the store's layout,
``policy.weight_store.version_path``) and nothing else — no listings, no trainer state, no value heads, no path
outside the store (symlinks resolved first). Anything else is 404 (405 for other methods). Threads from the stdlib's
``ThreadingHTTPServer``: a download of a big file never holds up the training loop. Engines fetch with
``policy.weight_fetch``, checking size and sha256 against the event.

Used by the learner when ``weights_http_port`` is set (``--weights-http-port``); the published URIs then start with
``weights_base_url`` (default ``http://<this host's name>:<port>``). Any other server of the store directory (nginx,
an object store's HTTP endpoint) works too: set only ``weights_base_url`` (docs/scaling.md, "Weights without a
shared filesystem").
"""

from __future__ import annotations

import logging
import re
import shutil
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from policy.weight_fetch import is_remote
from policy.weight_store import SavedWeights
from schemas.events import WeightVersion

log = logging.getLogger("clawstream.learner.weights_http")
SERVED = re.compile(r"^/[A-Za-z0-9._-]+/v\d{6}(-[0-9a-f-]+)?/model\.safetensors$")  # a version or an attempt


def published_uri(saved: SavedWeights, store: Path, base_url: str | None) -> str:
    """The URI engines are told: ``<base_url>/<model>/v<version>/model.safetensors``, or the file URI when unset."""
    if not base_url:
        return saved.uri
    return base_url.rstrip("/") + "/" + saved.path.resolve().relative_to(store.resolve()).as_posix()


def default_base_url(port: int) -> str:
    return f"http://{socket.getfqdn()}:{port}"


def local_copy(version: WeightVersion, store: Path) -> WeightVersion:
    """``version`` pointing at the learner's own file: a resuming learner reads its store, not its own server."""
    if not is_remote(version.uri):
        return version
    *_, directory, name = urllib.parse.urlparse(version.uri).path.split("/")  # <model>/<vNNNNNN-attempt>/<file>
    return replace(version, uri=(store / version.model_name / directory / name).resolve().as_uri())


class WeightsServer:
    """Serve ``store`` on ``host:port`` (port 0: any free one) from a daemon thread until :meth:`close`."""

    def __init__(self, store: Path, host: str = "0.0.0.0", port: int = 0) -> None:
        root = store.resolve()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                self._serve(body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(body=False)

            def _refuse(self) -> None:
                self.send_error(HTTPStatus.METHOD_NOT_ALLOWED, "read-only: GET or HEAD of a version's file")

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

            def _serve(self, *, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                target = (root / path.lstrip("/")).resolve() if SERVED.match(path) else None
                if target is None or not target.is_relative_to(root) or not target.is_file():
                    self.send_error(HTTPStatus.NOT_FOUND, "no such weight version")
                    return
                with open(target, "rb") as f:
                    self.send_response(HTTPStatus.OK)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(target.stat().st_size))
                    self.end_headers()
                    if body:
                        shutil.copyfileobj(f, self.wfile, 1 << 20)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the stdlib's signature)
                log.info("%s %s", self.address_string(), format % args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="weights-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@contextmanager
def serving(store: Path, port: int | None) -> Iterator[WeightsServer | None]:
    """A :class:`WeightsServer` of ``store`` on ``port`` for the block; nothing when ``port`` is None."""
    server = WeightsServer(store, port=port) if port is not None else None
    try:
        yield server
    finally:
        if server is not None:
            server.close()
