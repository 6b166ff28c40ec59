"""A TCP relay: the one peer a sandbox can reach, forwarding to the serving proxy (docker and isolated local).

Why: rollout containers sit on an internal network whose bridge has no host address (``inhibit_ipv4``), so nothing
outside that network — host services included — is reachable from them. When the proxy itself does not join that
network (the sandbox worker and the proxy run on the host, as in the tests and the demo), the docker backend starts
one relay container per worker: on the sandbox network (its name is the proxy's host name for the harnesses) and on
Docker's default bridge, from which it forwards every connection to the proxy's port on the host. It relays bytes;
HTTP, streaming and the proxy's per-rollout secrets pass through unchanged.

The isolated local backend (``producers.sandbox.bwrap``) has no network at all inside: the worker serves a unix socket
per sandbox (:func:`unix_server`, to the proxy's host and port) that is bound into it, and every command there starts
under ``--then``: a listener on ``127.0.0.1:PORT`` inside, forwarding to that socket, is bound first, served by a forked
child, and the command is exec'd (run by path, stdlib only). Bounded (every relayed connection is two fds of the
relaying process): at most ``max_connections`` at once per sandbox (the worker's unix socket stops accepting at the cap;
a TCP relay closes a peer's connection over it), each closed after ``idle_timeout_s`` without a byte, all closed when
the relay is (the sandbox's destroy). Lost calls: it records per sandbox (peer address) each upstream failure: a failed
connect to the proxy, or the proxy's side closing a connection after request bytes went up and before any response byte
came back (the client still connected); the worker reads the records of its relay, out of the rollout's reach
(``Sandbox.proxy_failures``). Topics: none. Run::

    python3 -m producers.sandbox.relay --listen 0.0.0.0:8100 --target 172.17.0.1:8100
    python3 relay.py --listen 127.0.0.1:8100 --target-unix /run/clawstream/proxy.sock --then CMD ARG...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import socket
import sys
from collections.abc import Awaitable, Callable

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]

# A harness holds a few connections to the proxy at once (its calls, a side model's, subagents'); the cap is per
# sandbox (per peer address of a TCP relay), so one rollout cannot hold the worker's file descriptors.
MAX_CONNECTIONS = 64
# Above the proxy's engine_timeout_s (900 s): a non-streaming call may wait that long without a byte.
IDLE_TIMEOUT_S = 960.0
# Upstream failures kept per peer (the first ones: what a re-issue's reason names); the count goes on.
MAX_FAILURES_KEPT = 8
UPSTREAM_FAILURE = "relay: upstream failure"  # the log line's start (the docker backend reads its relay's log)


class _Conn:
    """One relayed connection: its ends (client, then upstream) and when a byte last went either way."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.last = asyncio.get_running_loop().time()
        self.aborted = False
        self.awaiting = False  # request bytes went up since the last response byte came back
        self.client_done = False  # the client's side ended (EOF or error)
        self.lost: str | None = None  # how the proxy's side ended while a request was unanswered

    def ended(self, upstream: bool, how: str) -> None:
        """One side stopped sending: the client's, or the proxy's (a lost call when a request was unanswered)."""
        if not upstream:
            self.client_done = True
        elif self.awaiting and not self.client_done and not self.aborted and self.lost is None:
            self.lost = how

    def abort(self) -> None:
        self.aborted = True
        for w in self.writers:
            w.transport.abort()  # the fd is released now, whatever is still buffered


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn, *, upstream: bool) -> None:
    """Copy ``reader`` to ``writer``; ``upstream``: ``reader`` is the proxy's side."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                data = await reader.read(1 << 16)
            except (ConnectionError, OSError) as exc:
                conn.ended(upstream, f"{type(exc).__name__}: {exc}")
                return
            if not data:
                conn.ended(upstream, "closed")
                return
            conn.last = loop.time()
            conn.awaiting = not upstream
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()  # half-close: the peer still sends its answer


async def _streams(sock: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


class Relay:
    """The connections of one relay: at most ``max_connections`` per peer address, each closed after
    ``idle_timeout_s`` without a byte either way, every one closed by :meth:`close`."""

    def __init__(self, connect: Connect, name: str, max_connections: int, idle_timeout_s: float) -> None:
        self.connect, self.name = connect, name
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self.open: dict[str, set[_Conn]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.room = asyncio.Event()  # set when a connection ends
        self.refused = 0
        self.closed = False
        self.failures: dict[str, list[str]] = {}  # peer → the first upstream failures seen (MAX_FAILURES_KEPT)
        self.failure_counts: dict[str, int] = {}

    def failed(self, key: str, why: str) -> None:
        """Record an upstream failure seen on a connection of peer ``key`` (and log it, one line)."""
        self.failure_counts[key] = self.failure_counts.get(key, 0) + 1
        kept = self.failures.setdefault(key, [])
        if len(kept) < MAX_FAILURES_KEPT:
            kept.append(why)
        print(f"{UPSTREAM_FAILURE} {key or '-'}: {why}", file=sys.stderr, flush=True)

    def failures_seen(self, key: str = "") -> list[str]:
        """The upstream failures seen on peer ``key``'s connections (the first ``MAX_FAILURES_KEPT``, then a count)."""
        kept = list(self.failures.get(key, ()))
        more = self.failure_counts.get(key, 0) - len(kept)
        return kept + ([f"and {more} more"] if more > 0 else [])

    def full(self, key: str) -> bool:
        return len(self.open.get(key, ())) >= self.max_connections

    def admit(self, sock: socket.socket, key: str) -> None:
        """Relay an accepted connection, or close it at once when its peer holds ``max_connections`` already."""
        if self.closed or self.full(key):
            sock.close()
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # 1, 2, 4, ...: a flood does not flood the log
                print(f"relay: {key} holds {self.max_connections}: {self.refused} refused", file=sys.stderr, flush=True)
            return
        conn = _Conn()
        self.open.setdefault(key, set()).add(conn)
        task = asyncio.get_running_loop().create_task(self._serve(sock, conn, key))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _serve(self, sock: socket.socket, conn: _Conn, key: str) -> None:
        try:
            try:
                client_r, client_w = await _streams(sock)
            except BaseException:
                sock.close()
                raise
            conn.writers.append(client_w)
            if not conn.aborted:
                await self._relay(client_r, conn, key)
        except OSError:
            pass
        finally:
            conns = self.open.get(key, set())
            conns.discard(conn)
            if not conns:
                self.open.pop(key, None)
            self.room.set()
            for w in conn.writers:
                w.close()

    async def _relay(self, client_r: asyncio.StreamReader, conn: _Conn, key: str) -> None:
        try:
            up_r, up_w = await asyncio.wait_for(self.connect(), self.idle_timeout_s)
        except OSError as exc:  # TimeoutError too
            self.failed(key, f"cannot reach {self.name}: {type(exc).__name__}: {exc}")
            return
        conn.writers.append(up_w)
        if conn.aborted:  # closed while it connected
            up_w.transport.abort()
            return
        watch = asyncio.create_task(self._watch(conn))
        try:
            await asyncio.gather(
                _pipe(client_r, up_w, conn, upstream=False), _pipe(up_r, conn.writers[0], conn, upstream=True)
            )
        finally:
            watch.cancel()
        if conn.lost is not None and not conn.aborted:
            self.failed(key, f"{self.name} ended a connection with a request unanswered ({conn.lost})")

    async def _watch(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        while (left := conn.last + self.idle_timeout_s - loop.time()) > 0:
            await asyncio.sleep(left)
        conn.abort()

    def close(self) -> None:
        """Close every connection now (their fds are released on the loop's next turns)."""
        self.closed = True
        for conns in list(self.open.values()):
            for conn in list(conns):
                conn.abort()
        for task in list(self.tasks):
            task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.gather(*list(self.tasks), return_exceptions=True)


class RelayServer(asyncio.AbstractServer):
    """A listening relay. ``one_peer`` (a unix socket bound into one sandbox): at the cap it accepts nothing more
    until a connection ends (the rest wait in the kernel's backlog, holding no fd of ours); otherwise a peer over
    the cap is closed as it is accepted. ``close()`` stops accepting and closes every connection it relays."""

    def __init__(self, sock: socket.socket, relay: Relay, *, one_peer: bool) -> None:
        self.sock, self.relay, self.one_peer = sock, relay, one_peer
        sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._accepting = self._loop.create_task(self._accept())
        self._accepting.add_done_callback(lambda _: sock.close())  # after the loop let go of its fd

    async def _accept(self) -> None:
        while True:
            while self.one_peer and self.relay.full(""):
                self.relay.room.clear()
                await self.relay.room.wait()
            try:
                conn, addr = await self._loop.sock_accept(self.sock)
            except OSError as exc:  # EMFILE and the like: try again shortly, never stop serving
                print(f"relay: accept failed: {exc!r}", file=sys.stderr, flush=True)
                await asyncio.sleep(0.5)
                continue
            self.relay.admit(conn, "" if self.one_peer or not isinstance(addr, tuple) else addr[0])

    def close(self) -> None:
        self._accepting.cancel()
        self.relay.close()

    async def wait_closed(self) -> None:
        await asyncio.gather(self._accepting, return_exceptions=True)
        await self.relay.wait_closed()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return not self._accepting.done()

    async def start_serving(self) -> None:
        return None

    async def serve_forever(self) -> None:
        await self._accepting


def _connect(target_host: str, target_port: int | None, target_unix: str | None) -> Connect:
    if target_unix is not None:
        return lambda: asyncio.open_unix_connection(target_unix)
    return lambda: asyncio.open_connection(target_host, target_port)


async def relay(
    listen_host: str,
    listen_port: int,
    target_host: str,
    target_port: int | None,
    *,
    target_unix: str | None = None,
    sock: socket.socket | None = None,
    max_connections: int = MAX_CONNECTIONS,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    one_peer: bool = False,
) -> None:
    """Serve until cancelled; ``max_connections`` is per peer address (the docker relay serves every sandbox of its
    worker), or in all with ``one_peer`` (inside one sandbox; see :class:`RelayServer`)."""
    name = target_unix or f"{target_host}:{target_port}"
    bounds = Relay(_connect(target_host, target_port, target_unix), name, max_connections, idle_timeout_s)
    if sock is None:
        sock = socket.create_server((listen_host, listen_port), backlog=128)
        print(f"relay: {listen_host}:{listen_port} -> {name}", flush=True)
    async with RelayServer(sock, bounds, one_peer=one_peer) as served:
        await served.serve_forever()


async def unix_server(
    path: str,
    target_host: str,
    target_port: int,
    *,
    max_connections: int = MAX_CONNECTIONS,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
) -> RelayServer:
    """The worker's side for one isolated local sandbox: a unix socket at ``path`` forwarding to the proxy, holding at
    most ``max_connections`` at once; closing it closes them all."""
    name = f"{target_host}:{target_port}"
    bounds = Relay(_connect(target_host, target_port, None), name, max_connections, idle_timeout_s)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)  # the sandbox's uid connects to it
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return RelayServer(sock, bounds, one_peer=True)


def relay_failures(log_text: str, peer: str) -> list[str]:
    """The upstream failures a relay logged (:meth:`Relay.failed`) for ``peer``, from its log's text."""
    start = f"{UPSTREAM_FAILURE} {peer}: "
    return [line[len(start) :] for line in log_text.splitlines() if line.startswith(start)]


def raise_open_files_limit() -> int:
    """Raise this process's RLIMIT_NOFILE to its hard limit (the worker relays many sandboxes); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _then(listen: tuple[str, int], target_unix: str, argv: list[str]) -> int:
    """Bind the listener, fork a child that serves it, exec ``argv`` (the child dies with the sandbox)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(listen)
    sock.listen(128)
    if os.fork() == 0:
        try:
            os.setsid()  # not in the command's process group: the command's own group kills leave it be
            for fd in (0, 1, 2):
                os.dup2(os.open(os.devnull, os.O_RDWR), fd)
            asyncio.run(relay(*listen, "", None, target_unix=target_unix, sock=sock, one_peer=True))
        finally:
            os._exit(0)
    sock.close()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"relay: cannot exec {argv[0]}: {exc}", file=sys.stderr, flush=True)
        return 127


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producers.sandbox.relay", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=_host_port, default=("0.0.0.0", 8100), help="HOST:PORT to accept on")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--target", type=_host_port, help="HOST:PORT of the serving proxy")
    target.add_argument("--target-unix", help="unix socket leading to the serving proxy")
    parser.add_argument(
        "--max-connections", type=int, default=MAX_CONNECTIONS, help="connections held at once per peer address"
    )
    parser.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT_S, help="seconds without a byte: closed")
    parser.add_argument("--then", action="store_true", help="serve in a child, exec the rest of the command line")
    argv = sys.argv[1:] if argv is None else argv
    then: list[str] = []
    if "--then" in argv:  # everything after it is the command, verbatim (argparse would eat its "--")
        i = argv.index("--then")
        argv, then = argv[: i + 1], argv[i + 1 :]
    args = parser.parse_args(argv)
    if args.then:
        if args.target_unix is None or not then:
            parser.error("--then needs --target-unix and a command")
        return _then(args.listen, args.target_unix, then)
    if args.target_unix is not None:
        target_host, target_port = "", None
    else:
        target_host, target_port = args.target
    bounds = {"max_connections": args.max_connections, "idle_timeout_s": args.idle_timeout}
    asyncio.run(relay(*args.listen, target_host, target_port, target_unix=args.target_unix, **bounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
