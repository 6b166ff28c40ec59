"""Run OpenClaw's ``agent exec`` and leave its session transcript where PinchBench reads it (runs inside the sandbox).

OpenClaw 2026.9 keeps no session file: ``agent exec`` runs against a temporary state directory it deletes afterwards,
and with ``--state-dir DIR`` (retained) it stores transcripts in SQLite, ``DIR/agents/<agent>/agent/openclaw-agent
.sqlite`` (table ``transcript_events``: one session record per row, in order, as JSON text or — for records of
1 KiB to 4 MiB that compress well — as a Zstandard frame in ``event_zstd``). PinchBench's checks, ClawGym-Bench's
payload and ``producers.tasks.transcript.find_openclaw_session`` read the JSON-lines layout OpenClaw used to write::

    DIR/agents/<agent>/sessions/<session id>.jsonl     one record a line
    DIR/agents/<agent>/sessions/sessions.json          {session key: {"sessionId", "updatedAt"}}

so after OpenClaw exits this wrapper exports every session of the database into that layout. Zstandard frames are
decoded by the ``node`` on PATH (Node >= 23.8 has ``zlib.zstdDecompressSync``; OpenClaw runs on Node 24, first on
PATH). A session with a record that cannot be decoded is not exported at all (its grader then gets the transcript
built from what the proxy saw) rather than exported with a gap. Stdlib only; stdout is OpenClaw's, the exit status
OpenClaw's; export problems go to stderr.

Run::

    python openclaw_session.py --state-dir ~/.openclaw -- openclaw agent exec --state-dir ~/.openclaw ... PROMPT
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

AGENT_DB = "agent/openclaw-agent.sqlite"  # under <state dir>/agents/<agent>/
# Reads a JSON list of base64 Zstandard frames on stdin, writes the list of their UTF-8 texts.
NODE_UNZSTD = (
    "const z=require('zlib');const fs=require('fs');"
    "const frames=JSON.parse(fs.readFileSync(0,'utf8'));"
    "process.stdout.write(JSON.stringify(frames.map(b=>z.zstdDecompressSync(Buffer.from(b,'base64')).toString('utf8'))))"
)


class ExportError(Exception):
    """A session could not be exported faithfully."""


def unzstd(frames: list[bytes], node: str | None, timeout: float = 60.0) -> list[str]:
    """Decode Zstandard frames with Node's zlib (Python < 3.14 has no Zstandard in its standard library)."""
    if not frames:
        return []
    if node is None:
        raise ExportError("no node on PATH to decode Zstandard-compressed transcript records")
    payload = json.dumps([base64.b64encode(f).decode() for f in frames])
    try:
        proc = subprocess.run([node, "-e", NODE_UNZSTD], input=payload, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ExportError(f"node could not decode Zstandard records: {exc}") from exc
    if proc.returncode != 0:
        raise ExportError(f"node could not decode Zstandard records: {proc.stderr.strip()[-500:]}")
    texts = json.loads(proc.stdout)
    if not isinstance(texts, list) or len(texts) != len(frames):
        raise ExportError("node returned a wrong number of decoded records")
    return [str(t) for t in texts]


def session_lines(con: sqlite3.Connection, session_id: str, node: str | None) -> list[str]:
    """The session's records as JSON text, in order."""
    rows = con.execute(
        "SELECT seq, event_json, event_zstd FROM transcript_events WHERE session_id = ? ORDER BY seq", (session_id,)
    ).fetchall()
    frames = [bytes(z) for _seq, text, z in rows if text is None and z is not None]
    decoded = iter(unzstd(frames, node))
    lines = []
    for seq, text, z in rows:
        if text is None and z is None:
            raise ExportError(f"session {session_id} record {seq} has no body")
        line = text if text is not None else next(decoded)
        json.loads(line)  # each line must be one JSON record, as OpenClaw wrote it
        lines.append(line)
    return lines


def export_agent(db: Path, node: str | None) -> list[Path]:
    """Export every session of one agent database next to it (``../sessions/``); the files written."""
    sessions = db.parent.parent / "sessions"
    con = sqlite3.connect(db)
    try:
        nodes = con.execute("SELECT session_key, current_session_id, updated_at FROM session_nodes").fetchall()
        index: dict[str, dict[str, object]] = {}
        written = []
        for key, session_id, updated_at in nodes:
            try:
                lines = session_lines(con, session_id, node)
            except (ExportError, ValueError, StopIteration, sqlite3.Error) as exc:
                print(f"openclaw_session: session {session_id} not exported: {exc}", file=sys.stderr)
                continue
            if not lines:
                continue
            sessions.mkdir(parents=True, exist_ok=True)
            path = sessions / f"{session_id}.jsonl"
            path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            index[key] = {"sessionId": session_id, "updatedAt": updated_at}
            written.append(path)
        if index:
            (sessions / "sessions.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return written
    finally:
        con.close()


def export_sessions(state_dir: Path, node: str | None = None) -> list[Path]:
    """Export the sessions of every agent database under ``state_dir``; problems are reported on stderr."""
    node = node or shutil.which("node")
    written: list[Path] = []
    for db in sorted(state_dir.glob(f"agents/*/{AGENT_DB}")):
        try:
            written += export_agent(db, node)
        except (sqlite3.Error, OSError) as exc:
            print(f"openclaw_session: {db} not exported: {exc}", file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-dir", type=Path, required=True, help="OpenClaw's retained state dir (created)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then OpenClaw's command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no OpenClaw command given")
    args.state_dir.mkdir(parents=True, exist_ok=True)  # agent exec --state-dir wants an existing directory
    try:
        rc = subprocess.call(command)
    except OSError as exc:
        print(f"openclaw_session: cannot start {command[0]}: {exc}", file=sys.stderr)
        return 127
    export_sessions(args.state_dir)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
