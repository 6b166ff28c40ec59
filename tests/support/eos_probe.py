"""A minimal exactly-once Faust app on ``streams.eos``: the commit-boundary fault test runs it as a subprocess.

One agent counts records per key in a table and sends ``key:count`` to the output topic. A record whose value is
``commit-mid-record`` (:data:`COMMIT_MID_RECORD`) starts a commit itself, lets the commit run until it yields, sends a
second output (``key:count:after``) and finishes; once that commit is done the probe reaches the fault point
``eos_probe.after_commit`` (:data:`AFTER_COMMIT`), where the test's ``CLAWSTREAM_FAULTS`` makes it die at once
(``crash``: no goodbye, like SIGKILL). With commits between records (``streams.eos.CommitGate``) the commit waits for
the record, so the record's offset, table write and both outputs are in the same transaction and a restarted app does
not see it again. Without it, the commit takes the offsets before the record is acknowledged and its outputs land in
the transaction without its offset: the restarted app replays it and the output topic holds it twice.

Run: ``python -m tests.support.eos_probe --bootstrap HOST:PORT --app-id ID --source T --sink T --datadir DIR
[--commit-interval S]`` (the crash run passes a long interval: the record's own commit is the only one).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import faust
from faust.types import StreamT

from clawbase.faults import fault_point
from streams import eos

RAW: dict[str, Any] = {"key_serializer": "raw", "value_serializer": "raw"}
YIELDS_FOR_COMMIT = 200  # event-loop turns given to the commit once it has started (it reaches the broker well before)
COMMIT_MID_RECORD = b"commit-mid-record"  # a record with this value starts a commit while it is being processed
STALL = b"stall"  # a record with this value is never finished: no commit can happen after it (streams.eos.CommitGate)
STALLED = "eos_probe: stalled"  # printed when the probe takes a STALL record
LIVELOCK_CHECK = "eos_probe: livelock check"  # printed after each run of Faust's commit-livelock check
AFTER_COMMIT = "eos_probe.after_commit"  # reached once that commit is done


def build(
    app_id: str,
    bootstrap: str,
    source: str,
    sink: str,
    datadir: str,
    commit_interval_s: float,
    livelock_timeout_s: float | None = None,
) -> faust.App:
    watch = {} if livelock_timeout_s is None else _watch_livelock(livelock_timeout_s)
    app = faust.App(
        app_id,
        broker=f"kafka://{bootstrap}",
        store="memory://",
        datadir=datadir,
        processing_guarantee="exactly_once",
        topic_disable_leader=True,
        web_enabled=False,
        topic_partitions=1,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=6.0,
        broker_heartbeat_interval=2.0,  # the restart joins once the killed member's session expires
        broker_commit_interval=commit_interval_s,
        **watch,
    )
    eos.patch_faust_resume()
    eos.install(app)
    src, out = app.topic(source, **RAW), app.topic(sink, **RAW)
    counts = app.Table("counts", default=None, partitions=1, key_type=str, value_type=bytes)

    async def after(commit: asyncio.Future[Any]) -> None:
        await commit
        sys.stdout.flush()
        fault_point(AFTER_COMMIT)

    @app.agent(src, name="count")
    async def count(stream: StreamT) -> None:
        eos.start_agent(app)
        async for event in stream.events():
            async with eos.processing(app):
                key = event.message.key.decode()
                n = int(counts.get(key) or b"0") + 1
                counts[key] = str(n).encode()
                await out.send(key=key.encode(), value=f"{key}:{n}".encode(), partition=0)
                if event.message.value == COMMIT_MID_RECORD:
                    commit = asyncio.ensure_future(app.consumer.commit())
                    for _ in range(YIELDS_FOR_COMMIT):
                        await asyncio.sleep(0)
                    await out.send(key=key.encode(), value=f"{key}:{n}:after".encode(), partition=0)
                    asyncio.ensure_future(after(commit))
                if event.message.value == STALL:
                    print(STALLED, flush=True)
                    await asyncio.Event().wait()
                await eos.flush_changelog(app)

    return app


def _watch_livelock(timeout_s: float) -> dict[str, float]:
    """Faust's settings for a commit-livelock check after ``timeout_s`` (its stream-idle check much later, so that
    a partition's commits are what it judges), and a line on stdout after each run of the check."""
    from faust.transport.consumer import Consumer

    check = Consumer.verify_all_partitions_active

    async def verify_and_say(self: Consumer) -> None:
        await check(self)
        print(LIVELOCK_CHECK, flush=True)

    Consumer.verify_all_partitions_active = verify_and_say  # type: ignore[method-assign]
    return {"broker_commit_livelock_soft_timeout": timeout_s, "stream_processing_timeout": 600.0}


def main() -> None:
    flags = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    for name in ("--bootstrap", "--app-id", "--source", "--sink", "--datadir"):
        flags.add_argument(name, required=True)
    flags.add_argument("--commit-interval", type=float, default=0.5, help="seconds between Faust's own commits")
    flags.add_argument("--livelock-timeout", type=float, default=None, help="Faust's commit-livelock check after S")
    args = flags.parse_args()
    app = build(
        args.app_id,
        args.bootstrap,
        args.source,
        args.sink,
        args.datadir,
        args.commit_interval,
        args.livelock_timeout,
    )
    sys.argv = [sys.argv[0], "worker", "--loglevel", os.environ.get("EOS_PROBE_LOGLEVEL", "warn"), "--without-web"]
    app.main()


if __name__ == "__main__":
    main()
