"""The OpenClaw session export (``producers.harnesses.openclaw_session``): OpenClaw's SQLite transcript store → the
JSON-lines session files PinchBench (and ``find_openclaw_session``) read; a session it cannot decode is left out."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from producers.harnesses import openclaw_session as oc
from producers.tasks.transcript import find_openclaw_session, parse_session_jsonl

SCHEMA = """
CREATE TABLE session_nodes (session_key TEXT PRIMARY KEY, current_session_id TEXT NOT NULL, entry_json TEXT NOT NULL,
                            updated_at INTEGER NOT NULL);
CREATE TABLE transcript_events (session_id TEXT NOT NULL, seq INTEGER NOT NULL, event_json TEXT,
                                created_at INTEGER NOT NULL, event_zstd BLOB, event_utf8_bytes INTEGER,
                                navigation_json TEXT, PRIMARY KEY (session_id, seq));
"""


def records(sid: str, answer: str) -> list[dict]:
    return [
        {"type": "session", "version": 4, "id": sid, "timestamp": "2026-12-01T00:00:00.000Z", "cwd": "/ws"},
        {"type": "message", "id": "u", "parentId": None, "message": {"role": "user", "content": "Say hi"}},
        {
            "type": "message",
            "id": "a",
            "parentId": "u",
            "message": {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        },
    ]


def agent_db(state: Path, sessions: dict[str, list[dict | bytes]], agent: str = "main") -> Path:
    db = state / "agents" / agent / "agent" / "openclaw-agent.sqlite"
    db.parent.mkdir(parents=True)
    con = sqlite3.connect(db)
    con.executescript(SCHEMA)
    for n, (sid, rows) in enumerate(sessions.items()):
        con.execute("INSERT INTO session_nodes VALUES (?, ?, '{}', ?)", (f"agent:{agent}:explicit:{sid}", sid, 100 + n))
        for seq, row in enumerate(rows):
            text, blob = (None, row) if isinstance(row, bytes) else (json.dumps(row), None)
            con.execute(
                "INSERT INTO transcript_events (session_id, seq, event_json, created_at, event_zstd) "
                "VALUES (?, ?, ?, 0, ?)",
                (sid, seq, text, blob),
            )
    con.commit()
    con.close()
    return db


def test_export_writes_the_session_files_pinchbench_reads(tmp_path: Path) -> None:
    home = tmp_path / "home"
    state = home / ".openclaw"
    agent_db(state, {"s1": records("s1", "Hello, I'm ready!")})
    written = oc.export_sessions(state, node=None)
    sessions = state / "agents" / "main" / "sessions"
    assert written == [sessions / "s1.jsonl"]
    assert json.loads((sessions / "sessions.json").read_text()) == {
        "agent:main:explicit:s1": {"sessionId": "s1", "updatedAt": 100}
    }
    found = find_openclaw_session(home)
    assert found == sessions / "s1.jsonl"
    assert parse_session_jsonl(found.read_text()) == records("s1", "Hello, I'm ready!")


def test_a_session_with_an_undecodable_record_is_left_out(tmp_path: Path, capsys) -> None:
    state = tmp_path / ".openclaw"
    agent_db(state, {"bad": [*records("bad", "x")[:2], b"\x28\xb5\x2f\xfd not really"], "ok": records("ok", "hi")})
    written = oc.export_sessions(state, node=None)  # no node: a Zstandard record cannot be decoded
    assert [p.name for p in written] == ["ok.jsonl"]
    assert "session bad not exported" in capsys.readouterr().err
    index = json.loads((state / "agents" / "main" / "sessions" / "sessions.json").read_text())
    assert list(index) == ["agent:main:explicit:ok"]


def test_wrapper_creates_the_state_dir_exports_and_keeps_the_exit_status(tmp_path: Path) -> None:
    state = tmp_path / "state"
    code = "import sys; print('out'); sys.exit(3)"
    assert oc.main(["--state-dir", str(state), "--", sys.executable, "-c", code]) == 3
    assert state.is_dir() and not (state / "agents").exists()
    assert oc.main(["--state-dir", str(state), "--", str(tmp_path / "missing")]) == 127
