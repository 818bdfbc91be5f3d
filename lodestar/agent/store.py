"""The agent's sessions and the web app's chat conversations, with their messages, kept in
one SQLite file (stdlib ``sqlite3``). A session's ``kind`` tells them apart: ``agent`` (a
project folder, tools) or ``chat`` (no project; its generation ``settings`` as JSON).

A damaged or foreign file is refused with a `StoreError` and never written to: the
checks (`PRAGMA quick_check`, schema version) run before any pragma or statement that
writes. One `AgentStore` holds one connection; it may be called from any thread but runs
one call at a time (a lock), so an asyncio app can use it from worker threads. Several
processes may open the same file at once: WAL mode plus a busy timeout.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

ROLES = ("system", "user", "assistant", "tool", "marker")
MODES = ("read-only", "ask", "auto")
KINDS = ("agent", "chat")          # a coding-agent session in a project, or a plain chat (project '')
TITLE_CHARS = 60
BUSY_TIMEOUT_MS = 5000

# MIGRATIONS[i] takes a file from schema version i to i + 1 (PRAGMA user_version).
MIGRATIONS: list[str] = [
    """
    CREATE TABLE sessions (
        id          TEXT PRIMARY KEY,
        project     TEXT NOT NULL,
        model       TEXT NOT NULL,
        mode        TEXT NOT NULL,
        title       TEXT NOT NULL DEFAULT '',
        created     REAL NOT NULL,
        last_used   REAL NOT NULL,
        kv_identity TEXT
    );
    CREATE INDEX sessions_by_project ON sessions (project, last_used);
    CREATE TABLE messages (
        id            INTEGER PRIMARY KEY,
        session_id    TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        seq           INTEGER NOT NULL,
        role          TEXT NOT NULL,
        content       TEXT NOT NULL,
        tool_calls    TEXT,
        tool_call_id  TEXT,
        name          TEXT,
        tokens_in     INTEGER NOT NULL DEFAULT 0,
        tokens_cached INTEGER NOT NULL DEFAULT 0,
        tokens_out    INTEGER NOT NULL DEFAULT 0,
        duration_ms   INTEGER NOT NULL DEFAULT 0,
        approval      TEXT,
        meta          TEXT,
        created       REAL NOT NULL,
        UNIQUE (session_id, seq)
    );
    """,
    """
    ALTER TABLE sessions ADD COLUMN kind TEXT NOT NULL DEFAULT 'agent';
    ALTER TABLE sessions ADD COLUMN settings TEXT;
    CREATE INDEX sessions_by_kind ON sessions (kind, last_used);
    """,
]
SCHEMA_VERSION: int = len(MIGRATIONS)


class StoreError(Exception):
    """The agent database cannot be used as asked; the message says why and what to do."""


def default_db_path() -> Path:
    """``$XDG_DATA_HOME/lodestar/agent.db``, else ``~/.local/share/lodestar/agent.db``."""
    data_home = os.environ.get("XDG_DATA_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    base = Path(data_home) if os.path.isabs(data_home) else Path.home() / ".local" / "share"
    return base / "lodestar" / "agent.db"


@dataclass
class SessionInfo:
    id: str
    project: str
    model: str
    mode: str
    title: str
    created: float
    last_used: float
    kv_identity: str | None
    message_count: int
    kind: str = "agent"
    settings: dict | None = None   # a chat's generation settings (JSON object), None when never set


@dataclass
class StoredMessage:
    id: int
    session_id: str
    seq: int                       # 1, 2, 3 … in the order the messages were added
    role: str
    content: str
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    tokens_in: int = 0
    tokens_cached: int = 0
    tokens_out: int = 0
    duration_ms: int = 0
    approval: dict | None = None
    meta: dict | None = None
    created: float = 0.0


_SESSION_COLUMNS = (
    "s.id, s.project, s.model, s.mode, s.title, s.created, s.last_used, s.kv_identity, "
    "(SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id), s.kind, s.settings"
)
_MESSAGE_COLUMNS = (
    "id, session_id, seq, role, content, tool_calls, tool_call_id, name, tokens_in, "
    "tokens_cached, tokens_out, duration_ms, approval, meta, created"
)


def _title_from(prompt: str) -> str:
    flat = " ".join(prompt.split())
    return flat if len(flat) <= TITLE_CHARS else flat[: TITLE_CHARS - 1].rstrip() + "…"


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown permission mode {mode!r}; use one of {', '.join(MODES)}")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown session kind {kind!r}; use one of {', '.join(KINDS)}")


def _like_pattern(text: str) -> str:
    """A LIKE pattern matching ``text`` anywhere, its own ``%``, ``_`` and ``\\`` taken literally."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _to_json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def _from_json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class AgentStore:
    """Sessions and messages in the SQLite file at ``path`` (created with its folders)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        in_memory = str(path) == ":memory:"
        if not in_memory:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(
                    f"cannot create the folder for agent database {self.path} ({e}); "
                    "pass --db PATH to use another file"
                ) from e
        try:
            # isolation_level=None: transactions are opened explicitly (BEGIN IMMEDIATE)
            # so a read never upgrades to a write lock halfway through.
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                str(path), isolation_level=None, check_same_thread=False,
                timeout=BUSY_TIMEOUT_MS / 1000,
            )
        except sqlite3.Error as e:
            raise StoreError(
                f"cannot open agent database {self.path} ({e}); check the path or pass --db PATH"
            ) from e
        try:
            self._open()
        except BaseException:
            self._conn.close()
            self._conn = None
            raise

    # -- opening --------------------------------------------------------------------

    def _explain(self, error: sqlite3.Error) -> StoreError:
        """A StoreError for an sqlite3 error: damage, a lock held too long, or anything else."""
        text = str(error)
        if any(word in text for word in ("not a database", "malformed", "corrupt")):
            return self._damaged(text)
        if "locked" in text or "busy" in text:
            return StoreError(
                f"agent database {self.path} stayed locked by another process for "
                f"{BUSY_TIMEOUT_MS / 1000:g} s; try again"
            )
        return StoreError(
            f"cannot use agent database {self.path} ({text}); check that the file and its "
            "folder exist and are writable, or pass --db PATH"
        )

    def _damaged(self, why: str) -> StoreError:
        return StoreError(
            f"agent database {self.path} is damaged ({why}); move it aside or pass --db PATH"
        )

    def _open(self) -> None:
        conn = self._conn
        assert conn is not None
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")   # sets a handler, writes nothing
        # Read-only checks first: nothing may be written to a file we do not understand.
        try:
            problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]
        except sqlite3.Error as e:
            raise self._explain(e) from e
        if problems != ["ok"]:
            raise self._damaged("; ".join(problems[:3]))
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"agent database {self.path} has schema version {version}, newer than this "
                f"lodestar understands ({SCHEMA_VERSION}); upgrade lodestar or pass --db PATH"
            )
        if version == 0 and tables:
            raise StoreError(
                f"{self.path} is an SQLite database of another program (no lodestar schema "
                "version); pass --db PATH to use another file"
            )
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except sqlite3.Error as e:
            raise self._explain(e) from e

    def _migrate(self) -> None:
        conn = self._conn
        assert conn is not None
        if conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Read again under the write lock: another process may have migrated meanwhile.
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for step in range(version, SCHEMA_VERSION):
                for statement in _statements(MIGRATIONS[step]):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {step + 1}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------

    @contextmanager
    def _use(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        """The connection under the lock; a write runs in one transaction."""
        with self._lock:
            conn = self._conn
            if conn is None:
                raise StoreError(f"agent database {self.path} is closed; open a new AgentStore")
            try:
                if not write:
                    yield conn
                    return
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except sqlite3.Error as e:
                raise self._explain(e) from e

    @staticmethod
    def _session_row(row: tuple) -> SessionInfo:
        *fields, settings = row
        return SessionInfo(*fields, settings=_from_json(settings))

    @staticmethod
    def _message_row(row: tuple) -> StoredMessage:
        (id_, session_id, seq, role, content, tool_calls, tool_call_id, name, tokens_in,
         tokens_cached, tokens_out, duration_ms, approval, meta, created) = row
        return StoredMessage(
            id=id_, session_id=session_id, seq=seq, role=role, content=content,
            tool_calls=_from_json(tool_calls), tool_call_id=tool_call_id, name=name,
            tokens_in=tokens_in, tokens_cached=tokens_cached, tokens_out=tokens_out,
            duration_ms=duration_ms, approval=_from_json(approval), meta=_from_json(meta),
            created=created,
        )

    def _require(self, conn: sqlite3.Connection, session_id: str) -> None:
        if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
            raise StoreError(f"no session {session_id} in {self.path}; `lodestar agent sessions` lists them")

    # -- sessions -------------------------------------------------------------------

    def create_session(self, project: str, model: str, mode: str, *, kind: str = "agent",
                       settings: dict | None = None, title: str = "") -> SessionInfo:
        """A new session. An agent session belongs to ``project`` (stored as its real path);
        a chat session belongs to no project and must be given ``project=""``."""
        _check_mode(mode)
        _check_kind(kind)
        if kind == "chat":
            if project:
                raise ValueError(f"a chat session belongs to no project; pass project='' (got {project!r})")
        else:
            project = os.path.realpath(project)
        now = time.time()
        with self._use(write=True) as conn:
            while True:   # 8 hex chars: a clash is rare, but cheap to rule out
                session_id = secrets.token_hex(4)
                if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
                    break
            conn.execute(
                "INSERT INTO sessions (id, project, model, mode, title, created, last_used, kind, settings) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (session_id, project, model, mode, title, now, now, kind, _to_json(settings)),
            )
        return SessionInfo(session_id, project, model, mode, title, now, now, None, 0, kind, settings)

    def session(self, id_or_prefix: str) -> SessionInfo:
        """The session whose id is ``id_or_prefix`` or the only one that starts with it."""
        if not id_or_prefix:
            raise StoreError("no session id given; `lodestar agent sessions` lists them")
        with self._use() as conn:
            rows = conn.execute(
                f"SELECT {_SESSION_COLUMNS} FROM sessions s "
                "WHERE s.id = ? OR substr(s.id, 1, ?) = ? ORDER BY s.id",
                (id_or_prefix, len(id_or_prefix), id_or_prefix),
            ).fetchall()
        exact = [r for r in rows if r[0] == id_or_prefix]
        if exact:
            return self._session_row(exact[0])
        if not rows:
            raise StoreError(f"no session {id_or_prefix} in {self.path}; `lodestar agent sessions` lists them")
        if len(rows) > 1:
            ids = ", ".join(r[0] for r in rows)
            raise StoreError(f"ambiguous prefix {id_or_prefix}: {ids}; give more characters")
        return self._session_row(rows[0])

    def find_session(self, id: str) -> SessionInfo | None:
        """The session whose id is exactly ``id``, or None (no prefixes: for callers given a full id)."""
        with self._use() as conn:
            row = conn.execute(f"SELECT {_SESSION_COLUMNS} FROM sessions s WHERE s.id = ?", (id,)).fetchone()
        return None if row is None else self._session_row(row)

    def sessions(self, project: str | None = None, limit: int = 50, *, kind: str | None = "agent",
                 query: str | None = None) -> list[SessionInfo]:
        """Sessions of ``kind`` (None: every kind), most recently used first; only those of
        ``project`` when given; only those whose title or any message contains ``query``
        (case-insensitive for ASCII letters) when given."""
        where, args = [], []
        if kind is not None:
            _check_kind(kind)
            where.append("s.kind = ?")
            args.append(kind)
        if project is not None:
            where.append("s.project = ?")
            args.append(os.path.realpath(project) if project else project)
        if query:
            pattern = _like_pattern(query)
            where.append("(s.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m "
                         "WHERE m.session_id = s.id AND m.content LIKE ? ESCAPE '\\'))")
            args += [pattern, pattern]
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        with self._use() as conn:
            rows = conn.execute(
                f"SELECT {_SESSION_COLUMNS} FROM sessions s {clause} "
                "ORDER BY s.last_used DESC, s.created DESC, s.rowid DESC LIMIT ?",
                (*args, limit),
            ).fetchall()
        return [self._session_row(r) for r in rows]

    def latest(self, project: str) -> SessionInfo | None:
        found = self.sessions(project, limit=1)
        return found[0] if found else None

    def update_session(self, id: str, *, mode: str | None = None, model: str | None = None,
                       kv_identity: str | None = None, title: str | None = None,
                       settings: dict | None = None) -> None:
        """Change the given fields (None leaves one as is; ``kv_identity=""`` clears it;
        ``settings`` replaces the whole object). Always marks the session as just used."""
        changes: dict[str, Any] = {"last_used": time.time()}
        if mode is not None:
            _check_mode(mode)
            changes["mode"] = mode
        if model is not None:
            changes["model"] = model
        if kv_identity is not None:
            changes["kv_identity"] = kv_identity or None
        if title is not None:
            changes["title"] = title
        if settings is not None:
            changes["settings"] = _to_json(settings)
        assignments = ", ".join(f"{column} = ?" for column in changes)
        with self._use(write=True) as conn:
            self._require(conn, id)
            conn.execute(f"UPDATE sessions SET {assignments} WHERE id = ?", (*changes.values(), id))

    def delete_session(self, id: str) -> None:
        """Remove the session and all its messages."""
        with self._use(write=True) as conn:
            self._require(conn, id)
            conn.execute("DELETE FROM sessions WHERE id = ?", (id,))

    # -- messages -------------------------------------------------------------------

    def add_message(self, session_id: str, role: str, content: str, *,
                    tool_calls: list[dict] | None = None, tool_call_id: str | None = None,
                    name: str | None = None, tokens_in: int = 0, tokens_cached: int = 0,
                    tokens_out: int = 0, duration_ms: int = 0, approval: dict | None = None,
                    meta: dict | None = None) -> StoredMessage:
        """Append a message; the first user message also becomes the session's title."""
        if role not in ROLES:
            raise ValueError(f"unknown message role {role!r}; use one of {', '.join(ROLES)}")
        now = time.time()
        with self._use(write=True) as conn:
            self._require(conn, session_id)
            seq = conn.execute(
                "SELECT COALESCE(MAX(seq), 0) + 1 FROM messages WHERE session_id = ?", (session_id,)
            ).fetchone()[0]
            cursor = conn.execute(
                f"INSERT INTO messages ({_MESSAGE_COLUMNS}) "
                "VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (session_id, seq, role, content, _to_json(tool_calls), tool_call_id, name,
                 tokens_in, tokens_cached, tokens_out, duration_ms, _to_json(approval),
                 _to_json(meta), now),
            )
            conn.execute("UPDATE sessions SET last_used = ? WHERE id = ?", (now, session_id))
            if role == "user":
                conn.execute(
                    "UPDATE sessions SET title = ? WHERE id = ? AND title = ''",
                    (_title_from(content), session_id),
                )
        return StoredMessage(
            id=cursor.lastrowid, session_id=session_id, seq=seq, role=role, content=content,
            tool_calls=tool_calls, tool_call_id=tool_call_id, name=name, tokens_in=tokens_in,
            tokens_cached=tokens_cached, tokens_out=tokens_out, duration_ms=duration_ms,
            approval=approval, meta=meta, created=now,
        )

    def messages(self, session_id: str, since_seq: int = 0) -> list[StoredMessage]:
        """The session's messages with ``seq > since_seq``, in order."""
        with self._use() as conn:
            self._require(conn, session_id)
            rows = conn.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE session_id = ? AND seq > ? ORDER BY seq",
                (session_id, since_seq),
            ).fetchall()
        return [self._message_row(r) for r in rows]

    def delete_messages_from(self, session_id: str, seq: int) -> int:
        """Remove the session's messages with ``seq >= seq`` (an edited or regenerated turn and
        everything after it); the next message added takes the lowest free seq. Returns how many went."""
        with self._use(write=True) as conn:
            self._require(conn, session_id)
            cursor = conn.execute("DELETE FROM messages WHERE session_id = ? AND seq >= ?", (session_id, seq))
            conn.execute("UPDATE sessions SET last_used = ? WHERE id = ?", (time.time(), session_id))
        return cursor.rowcount

    def add_marker(self, session_id: str, summary: str, upto_seq: int) -> StoredMessage:
        """Record a compaction: ``summary`` stands for every message with ``seq <= upto_seq``."""
        return self.add_message(session_id, "marker", summary, meta={"upto": upto_seq})

    def context_messages(self, session_id: str) -> list[StoredMessage]:
        """What a conversation is rebuilt from: the latest marker, then every non-marker
        message after its ``upto``, in order. Without a marker, every message."""
        history = self.messages(session_id)
        markers = [m for m in history if m.role == "marker"]
        if not markers:
            return history
        marker = markers[-1]
        upto = (marker.meta or {}).get("upto", marker.seq)
        return [marker] + [m for m in history if m.role != "marker" and m.seq > upto]

    def totals(self, session_id: str) -> dict:
        """Sums over the session's messages: tokens_in, tokens_cached, tokens_out, duration_ms."""
        with self._use() as conn:
            self._require(conn, session_id)
            row = conn.execute(
                "SELECT COALESCE(SUM(tokens_in), 0), COALESCE(SUM(tokens_cached), 0), "
                "COALESCE(SUM(tokens_out), 0), COALESCE(SUM(duration_ms), 0) "
                "FROM messages WHERE session_id = ?",
                (session_id,),
            ).fetchone()
        return dict(zip(("tokens_in", "tokens_cached", "tokens_out", "duration_ms"), row))


def _statements(script: str) -> list[str]:
    """Split a migration script into statements (``executescript`` would commit on its own)."""
    statements, pending = [], ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statements.append(pending.strip())
            pending = ""
    if pending.strip():
        raise ValueError(f"incomplete SQL statement in a migration: {pending.strip()[:80]}")
    return statements
