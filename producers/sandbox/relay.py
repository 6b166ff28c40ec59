"""A TCP relay: the one peer a sandbox can reach, forwarding to the serving proxy (docker and isolated local).

Why: rollout containers sit on an internal network whose bridge has no host address (``inhibit_ipv4``), so nothing
outside that network — host services included — is reachable from them. When the proxy itself does not join that
network (the sandbox worker and the proxy run on the host, as in the tests and the demo), the docker backend starts
one relay container per worker: on the sandbox network (its name is the proxy's host name for the harnesses) and on
Docker's default bridge, from which it forwards every connection to the proxy's port on the host. It relays bytes;
HTTP, streaming and the proxy's per-rollout secrets pass through unchanged.

The isolated local backend (``producers.sandbox.bwrap``) has no network at all inside: the worker serves a unix
socket per sandbox (:func:`unix_server`, to the proxy's host and port) that is bound into it, and every command
there starts under ``--then``: a listener on ``127.0.0.1:PORT`` inside, forwarding to that socket, is bound first,
served by a forked child, and the command is exec'd (run by path, stdlib only).

Topics: none. Run::

    python3 -m producers.sandbox.relay --listen 0.0.0.0:8100 --target 172.17.0.1:8100
    python3 relay.py --listen 127.0.0.1:8100 --target-unix /run/clawstream/proxy.sock --then CMD ARG...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import Awaitable, Callable

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()  # half-close: the peer still sends its answer


def _handler(connect: Connect, name: str):  # noqa: ANN202 - an asyncio client_connected_cb
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await connect()
        except OSError as exc:
            print(f"relay: cannot reach {name}: {exc}", file=sys.stderr, flush=True)
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
        for w in (client_w, up_w):
            w.close()

    return handle


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
) -> None:
    name = target_unix or f"{target_host}:{target_port}"
    handle = _handler(_connect(target_host, target_port, target_unix), name)
    if sock is not None:
        server = await asyncio.start_server(handle, sock=sock)
    else:
        server = await asyncio.start_server(handle, listen_host, listen_port)
        print(f"relay: {listen_host}:{listen_port} -> {name}", flush=True)
    async with server:
        await server.serve_forever()


async def unix_server(path: str, target_host: str, target_port: int) -> asyncio.AbstractServer:
    """The worker's side for one isolated local sandbox: a unix socket at ``path`` forwarding to the proxy."""
    handle = _handler(_connect(target_host, target_port, None), f"{target_host}:{target_port}")
    server = await asyncio.start_unix_server(handle, path)
    os.chmod(path, 0o666)  # the sandbox's uid connects to it
    return server


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
            asyncio.run(relay(*listen, "", None, target_unix=target_unix, sock=sock))
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
        asyncio.run(relay(*args.listen, "", None, target_unix=args.target_unix))
    else:
        asyncio.run(relay(*args.listen, *args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
