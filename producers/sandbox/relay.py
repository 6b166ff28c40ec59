"""A TCP relay: the one peer a docker sandbox can reach, forwarding to the serving proxy.

Why: rollout containers sit on an internal network whose bridge has no host address (``inhibit_ipv4``), so nothing
outside that network — host services included — is reachable from them. When the proxy itself does not join that
network (the sandbox worker and the proxy run on the host, as in the tests and the demo), the docker backend starts
one relay container per worker: on the sandbox network (its name is the proxy's host name for the harnesses) and on
Docker's default bridge, from which it forwards every connection to the proxy's port on the host. It relays bytes;
HTTP, streaming and the proxy's per-rollout secrets pass through unchanged.

Topics: none. Run (inside the sandbox image, started by ``producers.sandbox.docker_backend``)::

    python3 -m producers.sandbox.relay --listen 0.0.0.0:8100 --target 172.17.0.1:8100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys


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


async def relay(listen_host: str, listen_port: int, target_host: str, target_port: int) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(target_host, target_port)
        except OSError as exc:
            print(f"relay: cannot reach {target_host}:{target_port}: {exc}", file=sys.stderr, flush=True)
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
        for w in (client_w, up_w):
            w.close()

    server = await asyncio.start_server(handle, listen_host, listen_port)
    print(f"relay: {listen_host}:{listen_port} -> {target_host}:{target_port}", flush=True)
    async with server:
        await server.serve_forever()


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producers.sandbox.relay", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=_host_port, default=("0.0.0.0", 8100), help="HOST:PORT to accept on")
    parser.add_argument("--target", type=_host_port, required=True, help="HOST:PORT of the serving proxy")
    args = parser.parse_args(argv)
    asyncio.run(relay(*args.listen, *args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
