import os
import sqlite3
import threading

import pytest

from lodestar.agent.store import (
    SCHEMA_VERSION,
    AgentStore,
    StoredMessage,
    StoreError,
    default_db_path,
)


@pytest.fixture
def db(tmp_path):
    return tmp_path / "data" / "agent.db"


@pytest.fixture
def store(db):
    s = AgentStore(db)
    yield s
    s.close()


def _session_with_id(store, session_id, project="/p"):
    """A session with a chosen id, so prefix tests do not depend on random ids."""
    info = store.create_session(project, "m", "ask")
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE sessions SET id = ? WHERE id = ?", (session_id, info.id))
    return session_id


def test_default_path_follows_xdg_data_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_db_path() == tmp_path / "lodestar" / "agent.db"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_db_path() == tmp_path / "home" / ".local" / "share" / "lodestar" / "agent.db"


def test_fresh_file_is_created_with_folders_wal_and_schema_version(db):
    AgentStore(db).close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_create_list_and_resume(store, tmp_path):
    project = tmp_path / "proj"
    project.mkdir()
    (tmp_path / "link").symlink_to(project)
    a = store.create_session(str(tmp_path / "link"), "smollm2", "ask")
    b = store.create_session(str(project), "gemma", "auto")
    other = store.create_session(str(tmp_path), "smollm2", "read-only")
    assert a.project == str(project)          # stored as the real path
    assert len(a.id) == 8 and len({a.id, b.id, other.id}) == 3
    store.add_message(a.id, "user", "hello")  # a is now the most recently used
    assert [s.id for s in store.sessions(str(project))] == [a.id, b.id]
    assert store.sessions()[0].id == a.id
    assert len(store.sessions()) == 3
    assert len(store.sessions(limit=2)) == 2
    assert store.latest(str(project)).id == a.id
    assert store.latest(str(tmp_path / "nothing-here")) is None
    got = store.session(a.id)
    assert (got.model, got.mode, got.message_count, got.kv_identity) == ("smollm2", "ask", 1, None)


def test_resume_by_prefix(store):
    _session_with_id(store, "abc12345")
    _session_with_id(store, "abd00000")
    assert store.session("abc").id == "abc12345"
    assert store.session("abc12345").id == "abc12345"
    with pytest.raises(StoreError, match=r"ambiguous prefix ab: abc12345, abd00000"):
        store.session("ab")
    with pytest.raises(StoreError, match="no session zz"):
        store.session("zz")
    with pytest.raises(StoreError, match="no session"):
        store.session("")
    with pytest.raises(StoreError, match="no session a%"):
        store.session("a%")          # not a LIKE pattern


def test_title_is_the_first_user_prompt_cut_short(store):
    s = store.create_session("/p", "m", "ask")
    store.add_message(s.id, "system", "you are an agent")
    store.add_message(s.id, "user", "Fix   the failing\ntest in " + "x" * 100)
    store.add_message(s.id, "user", "second prompt")
    title = store.session(s.id).title
    assert title.startswith("Fix the failing test in xxx")
    assert len(title) <= 60 and title.endswith("…")


def test_update_session(store):
    s = store.create_session("/p", "m", "ask")
    before = store.session(s.id).last_used
    store.update_session(s.id, mode="auto", model="gemma", kv_identity="kv-1", title="T")
    got = store.session(s.id)
    assert (got.mode, got.model, got.kv_identity, got.title) == ("auto", "gemma", "kv-1", "T")
    assert got.last_used >= before
    store.update_session(s.id, mode="read-only")     # other fields stay
    assert store.session(s.id).kv_identity == "kv-1"
    store.update_session(s.id, kv_identity="")       # "" clears it
    assert store.session(s.id).kv_identity is None
    with pytest.raises(ValueError, match="read-only, ask, auto"):
        store.update_session(s.id, mode="yolo")
    with pytest.raises(StoreError, match="no session nope"):
        store.update_session("nope", mode="ask")
    with pytest.raises(ValueError):
        store.create_session("/p", "m", "sometimes")


def test_messages_round_trip_every_field(store):
    s = store.create_session("/p", "m", "ask")
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "read", "arguments": '{"path": "a.py"}'}}]
    a = store.add_message(s.id, "assistant", "", tool_calls=calls, tokens_in=120,
                          tokens_cached=100, tokens_out=7, duration_ms=350)
    t = store.add_message(s.id, "tool", "print('é')", tool_call_id="call_1", name="read",
                          approval={"action": "allow", "reason": "read-only tool", "by": "rule"},
                          meta={"ok": True, "diff": "--- a\n+++ b\n", "lines": [1, 2]})
    got = store.messages(s.id)
    assert got == [a, t]
    assert isinstance(got[1], StoredMessage)
    assert got[0].tool_calls == calls and got[0].tokens_cached == 100 and got[0].duration_ms == 350
    assert got[1].approval["by"] == "rule" and got[1].meta["lines"] == [1, 2]
    assert got[1].content == "print('é')" and got[1].tool_call_id == "call_1" and got[1].name == "read"
    assert got[0].created > 0
    with pytest.raises(ValueError, match="unknown message role"):
        store.add_message(s.id, "robot", "x")
    with pytest.raises(StoreError, match="no session"):
        store.add_message("missing", "user", "x")


def test_messages_keep_order_and_sessions_do_not_mix(store):
    a = store.create_session("/p", "m", "ask")
    b = store.create_session("/p", "m", "ask")
    for i in range(5):
        store.add_message(a.id, "user", f"a{i}")
        store.add_message(b.id, "user", f"b{i}")
    got = store.messages(a.id)
    assert [m.content for m in got] == [f"a{i}" for i in range(5)]
    assert [m.seq for m in got] == [1, 2, 3, 4, 5]
    assert [m.content for m in store.messages(a.id, since_seq=3)] == ["a3", "a4"]


def test_markers_and_context_messages(store):
    s = store.create_session("/p", "m", "ask")
    for i in range(1, 7):
        store.add_message(s.id, "user" if i % 2 else "assistant", f"m{i}")
    assert [m.content for m in store.context_messages(s.id)] == [f"m{i}" for i in range(1, 7)]
    first = store.add_marker(s.id, "summary of 1-4", upto_seq=4)
    assert first.role == "marker" and first.meta == {"upto": 4} and first.seq == 7
    store.add_message(s.id, "user", "m8")
    assert [m.content for m in store.context_messages(s.id)] == ["summary of 1-4", "m5", "m6", "m8"]
    store.add_marker(s.id, "summary of 1-6", upto_seq=6)
    store.add_message(s.id, "assistant", "m10")
    # Only the latest marker counts; the older marker is not part of the tail.
    assert [m.content for m in store.context_messages(s.id)] == ["summary of 1-6", "m8", "m10"]
    assert len(store.messages(s.id)) == 10      # compaction hides nothing from the history


def test_totals(store):
    s = store.create_session("/p", "m", "ask")
    assert store.totals(s.id) == {"tokens_in": 0, "tokens_cached": 0, "tokens_out": 0, "duration_ms": 0}
    store.add_message(s.id, "assistant", "a", tokens_in=100, tokens_cached=60, tokens_out=10, duration_ms=500)
    store.add_message(s.id, "assistant", "b", tokens_in=150, tokens_cached=100, tokens_out=5, duration_ms=250)
    other = store.create_session("/p", "m", "ask")
    store.add_message(other.id, "assistant", "c", tokens_in=9999)
    assert store.totals(s.id) == {"tokens_in": 250, "tokens_cached": 160, "tokens_out": 15, "duration_ms": 750}


def test_delete_takes_messages_with_it(store, db):
    s = store.create_session("/p", "m", "ask")
    keep = store.create_session("/p", "m", "ask")
    store.add_message(s.id, "user", "bye")
    store.add_message(keep.id, "user", "stay")
    store.delete_session(s.id)
    with pytest.raises(StoreError, match="no session"):
        store.session(s.id)
    assert [x.id for x in store.sessions()] == [keep.id]
    rows = sqlite3.connect(db).execute("SELECT content FROM messages").fetchall()
    assert rows == [("stay",)]
    with pytest.raises(StoreError, match="no session"):
        store.delete_session(s.id)


def test_two_stores_on_one_file(db):
    one, two = AgentStore(db), AgentStore(db)
    try:
        s = one.create_session("/p", "m", "ask")
        two.add_message(s.id, "user", "from two")
        one.add_message(s.id, "assistant", "from one")
        assert [m.seq for m in two.messages(s.id)] == [1, 2]
        assert one.session(s.id).message_count == 2
    finally:
        one.close()
        two.close()


def test_usable_from_worker_threads(store):
    s = store.create_session("/p", "m", "ask")
    errors = []

    def work(n):
        try:
            for i in range(10):
                store.add_message(s.id, "user", f"{n}-{i}")
        except Exception as e:  # noqa: BLE001 - any failure in a thread is reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [m.seq for m in store.messages(s.id)] == list(range(1, 41))


def test_reopen_after_close_keeps_everything(db):
    store = AgentStore(db)
    s = store.create_session("/p", "m", "auto")
    store.update_session(s.id, kv_identity="kv-9")
    store.add_message(s.id, "user", "remember me", meta={"k": 1})
    store.add_marker(s.id, "sum", upto_seq=1)
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.session(s.id)
    again = AgentStore(db)
    try:
        got = again.session(s.id)
        assert (got.title, got.mode, got.kv_identity, got.message_count) == ("remember me", "auto", "kv-9", 2)
        assert [m.content for m in again.context_messages(s.id)] == ["sum"]
        assert again.messages(s.id)[0].meta == {"k": 1}
    finally:
        again.close()


def test_newer_schema_version_is_refused_and_file_untouched(db):
    AgentStore(db).close()
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    before = db.read_bytes()
    with pytest.raises(StoreError, match="upgrade lodestar") as e:
        AgentStore(db)
    assert str(db) in str(e.value)
    assert db.read_bytes() == before


def test_foreign_sqlite_file_is_refused_and_untouched(db):
    db.parent.mkdir(parents=True)
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE photos (id INTEGER)")
    conn.commit()
    conn.close()
    before = db.read_bytes()
    with pytest.raises(StoreError, match="--db PATH"):
        AgentStore(db)
    assert db.read_bytes() == before


def _real_db_bytes(db):
    store = AgentStore(db)
    s = store.create_session("/p", "m", "ask")
    for i in range(200):
        store.add_message(s.id, "user", "x" * 400)
    store.close()
    data = db.read_bytes()
    db.unlink()
    return data


@pytest.mark.parametrize("kind", ["random", "truncated", "text"])
def test_damaged_file_is_refused_and_left_as_is(db, kind):
    data = {
        "random": lambda: os.urandom(8192),
        "truncated": lambda: _real_db_bytes(db)[: 4096 * 3],
        "text": lambda: b"# notes\n" * 500,
    }[kind]()
    db.parent.mkdir(parents=True, exist_ok=True)
    db.write_bytes(data)
    with pytest.raises(StoreError, match="is damaged") as e:
        AgentStore(db)
    assert str(db) in str(e.value) and "move it aside or pass --db PATH" in str(e.value)
    assert db.read_bytes() == data
    assert sorted(p.name for p in db.parent.iterdir()) == ["agent.db"]


def test_unopenable_path_says_what_to_do(tmp_path):
    with pytest.raises(StoreError, match="--db PATH"):
        AgentStore(tmp_path)          # a folder, not a file


# The schema of version 1 as it shipped; a real v1 file is built from it, not from MIGRATIONS.
V1_SCHEMA = """
CREATE TABLE sessions (
    id TEXT PRIMARY KEY, project TEXT NOT NULL, model TEXT NOT NULL, mode TEXT NOT NULL,
    title TEXT NOT NULL DEFAULT '', created REAL NOT NULL, last_used REAL NOT NULL, kv_identity TEXT
);
CREATE INDEX sessions_by_project ON sessions (project, last_used);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL, tool_calls TEXT, tool_call_id TEXT,
    name TEXT, tokens_in INTEGER NOT NULL DEFAULT 0, tokens_cached INTEGER NOT NULL DEFAULT 0,
    tokens_out INTEGER NOT NULL DEFAULT 0, duration_ms INTEGER NOT NULL DEFAULT 0, approval TEXT,
    meta TEXT, created REAL NOT NULL, UNIQUE (session_id, seq)
);
"""


def _v1_file(db):
    db.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db)
    conn.executescript(V1_SCHEMA)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO sessions VALUES ('abcd1234', '/proj', 'smollm2', 'ask', 'fix it', 1.0, 2.0, 'kv-1')")
    conn.execute("INSERT INTO messages (session_id, seq, role, content, tokens_in, meta, created) "
                 "VALUES ('abcd1234', 1, 'user', 'fix it', 0, NULL, 1.5)")
    conn.execute("INSERT INTO messages (session_id, seq, role, content, tokens_in, meta, created) "
                 "VALUES ('abcd1234', 2, 'assistant', 'done', 42, '{\"k\": 1}', 1.7)")
    conn.commit()
    conn.close()


def test_v1_file_is_migrated_keeping_every_session_and_message(db):
    _v1_file(db)
    store = AgentStore(db)
    try:
        old = store.session("abcd1234")
        assert (old.kind, old.settings, old.title, old.kv_identity, old.message_count) == \
            ("agent", None, "fix it", "kv-1", 2)
        got = store.messages("abcd1234")
        assert [(m.role, m.content, m.tokens_in, m.meta) for m in got] == \
            [("user", "fix it", 0, None), ("assistant", "done", 42, {"k": 1})]
        assert [s.id for s in store.sessions("/proj")] == ["abcd1234"]
        chat = store.create_session("", "m", "read-only", kind="chat", settings={"temperature": 0.5})
        assert store.session(chat.id).settings == {"temperature": 0.5}
    finally:
        store.close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    columns = [row[1] for row in conn.execute("PRAGMA table_info(sessions)")]
    assert columns[-2:] == ["kind", "settings"]


def test_chat_sessions_are_kept_apart_from_agent_sessions(store, db):
    agent = store.create_session("/p", "m", "ask")
    chat = store.create_session("", "m", "read-only", kind="chat", settings={"system": "be brief"}, title="Mine")
    assert (chat.project, chat.kind, chat.settings, chat.title) == ("", "chat", {"system": "be brief"}, "Mine")
    assert [s.id for s in store.sessions()] == [agent.id]             # agent listings never show chats
    assert [s.id for s in store.sessions(kind="chat")] == [chat.id]
    assert {s.id for s in store.sessions(kind=None)} == {agent.id, chat.id}
    assert store.latest("/p").id == agent.id
    assert store.find_session(chat.id) == chat
    assert store.find_session(chat.id[:4]) is None                   # exact ids only, no prefixes
    store.add_message(chat.id, "user", "first question")
    assert store.session(chat.id).title == "Mine"                     # a given title stays
    store.update_session(chat.id, settings={"temperature": 0.2})      # replaces the whole object
    store.update_session(chat.id, title="Renamed")                    # leaves settings alone
    again = AgentStore(db)
    try:
        got = again.session(chat.id)
        assert (got.kind, got.settings, got.title, got.project) == ("chat", {"temperature": 0.2}, "Renamed", "")
    finally:
        again.close()
    with pytest.raises(ValueError, match="project=''"):
        store.create_session("/p", "m", "ask", kind="chat")
    with pytest.raises(ValueError, match="agent, chat"):
        store.create_session("/p", "m", "ask", kind="notes")
    with pytest.raises(ValueError, match="agent, chat"):
        store.sessions(kind="notes")


def test_search_finds_titles_and_message_text_and_takes_wildcards_literally(store):
    def chat(title, *texts):
        s = store.create_session("", "m", "read-only", kind="chat", title=title)
        for t in texts:
            store.add_message(s.id, "user", t)
        return s.id

    by_title = chat("Trip to Lisbon", "plan a route")
    by_text = chat("Untitled", "what is 100% of x?")
    underscore = chat("snake_case names")
    plain = chat("snakeXcase names", "nothing here")
    agent = store.create_session("/p", "m", "ask")
    store.add_message(agent.id, "user", "lisbon is also here")

    def found(q):
        return {s.id for s in store.sessions(kind="chat", query=q)}

    assert found("lisbon") == {by_title}                   # case-insensitive; agent sessions left out
    assert found("100%") == {by_text}
    assert found("%") == {by_text}                         # % is a character, not "anything"
    assert found("e_c") == {underscore}                    # _ is a character, not "any one"
    assert found("\\") == set()
    assert found("") == {by_title, by_text, underscore, plain}
    assert {s.id for s in store.sessions(kind=None, query="LISBON")} == {by_title, agent.id}


def test_delete_messages_from_drops_that_turn_and_everything_after(store):
    s = store.create_session("", "m", "read-only", kind="chat")
    other = store.create_session("", "m", "read-only", kind="chat")
    for i in range(1, 6):
        store.add_message(s.id, "user" if i % 2 else "assistant", f"m{i}")
    store.add_message(other.id, "user", "untouched")
    assert store.delete_messages_from(s.id, 3) == 3
    assert [(m.seq, m.content) for m in store.messages(s.id)] == [(1, "m1"), (2, "m2")]
    assert store.add_message(s.id, "user", "edited").seq == 3          # seq continues where it was cut
    assert store.delete_messages_from(s.id, 99) == 0
    assert [m.content for m in store.messages(other.id)] == ["untouched"]
    with pytest.raises(StoreError, match="no session"):
        store.delete_messages_from("missing", 1)
