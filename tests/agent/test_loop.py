"""The tool loop against a scripted model: tools, approvals, Stop, queued prompts,
compaction, resume and loop runs, with a real store and real tools in a temp project."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from lodestar.agent.context import SUMMARY_HEADER
from lodestar.agent.loop import NOT_RUN, Agent, AgentConfig, Frontend, loop_run
from lodestar.agent.policy import AllowRule, Mode
from lodestar.agent.store import AgentStore
from tests.agent.scripted import Hang, ScriptedClient, call, reply


class Recorder(Frontend):
    def __init__(self, answers=()):
        self.answers = list(answers)
        self.asked, self.events, self.statuses = [], [], []

    def tool_start(self, call, assessment, decision):
        self.events.append(("start", call.name))

    def tool_end(self, call, result, decision):
        self.events.append(("end", call.name, result.ok))

    async def approve(self, call, assessment, decision):
        self.asked.append((call.name, assessment.summary))
        return self.answers.pop(0) if self.answers else (False, "denied in test")

    def status(self, message):
        self.statuses.append(message)


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "proj"
    root.mkdir()
    (root / "app.py").write_text("def greet():\n    return 'hello'\n")
    return root


@pytest.fixture
def store(tmp_path):
    s = AgentStore(tmp_path / "agent.db")
    yield s
    s.close()


def make(client, store, project, frontend=None, **cfg) -> Agent:
    session = store.create_session(str(project), "scripted", cfg.get("mode", Mode.ASK).value)
    return Agent(client, store, session, project, AgentConfig(**cfg), frontend or Recorder(),
                 spill_dir=project.parent / "spill")


def roles(store, agent):
    return [m.role for m in store.messages(agent.session.id)]


def test_tool_round_trip_is_stored_and_fed_back(project, store):
    client = ScriptedClient([reply("", call("read", path="app.py")), reply("It returns 'hello'.")])
    agent = make(client, store, project)
    stats = asyncio.run(agent.run("what does greet return?"))
    assert (stats.calls, stats.tools, stats.stopped) == (2, 1, False)
    assert roles(store, agent) == ["user", "assistant", "tool", "assistant"]
    tool_msg = client.requests[1]["messages"][-1]
    assert tool_msg["role"] == "tool" and tool_msg["tool_call_id"] == "c1" and "return 'hello'" in tool_msg["content"]
    assert client.requests[1]["messages"][-2]["tool_calls"][0]["function"]["name"] == "read"
    assert client.requests[0]["messages"][0]["role"] == "system"
    assert {t["function"]["name"] for t in client.requests[0]["tools"]} >= {"read", "write", "edit", "shell", "grep"}


def test_invalid_calls_return_errors_and_do_not_run(project, store):
    client = ScriptedClient([reply("", call("nope", x=1), call("write", id="c2", path="x.txt")), reply("ok")])
    agent = make(client, store, project, mode=Mode.AUTO)
    asyncio.run(agent.run("go"))
    results = [m for m in store.messages(agent.session.id) if m.role == "tool"]
    assert len(results) == 2 and not any(m.meta["ok"] for m in results)
    assert "nope" in results[0].content and "content" in results[1].content
    assert not (project / "x.txt").exists()


@pytest.mark.parametrize("answer, written", [((True, "yes"), True), ((False, "no: wrong file"), False)])
def test_ask_mode_asks_before_writing(project, store, answer, written):
    fe = Recorder([answer])
    client = ScriptedClient([reply("", call("write", path="new.txt", content="hi\n")), reply("done")])
    agent = make(client, store, project, fe, mode=Mode.ASK)
    asyncio.run(agent.run("write it"))
    assert len(fe.asked) == 1 and fe.asked[0][0] == "write"
    assert (project / "new.txt").exists() == written
    tool = [m for m in store.messages(agent.session.id) if m.role == "tool"][0]
    assert tool.approval["by"] == "user" and tool.approval["action"] == ("allow" if written else "deny")
    if not written:
        assert "wrong file" in tool.content


def test_read_only_mode_denies_without_asking(project, store):
    fe = Recorder([(True, "yes")])
    client = ScriptedClient([reply("", call("write", path="a.txt", content="x"), call("shell", id="c2",
                                                                                    command="touch b")),
                             reply("ok")])
    agent = make(client, store, project, fe, mode=Mode.READ_ONLY)
    asyncio.run(agent.run("go"))
    assert fe.asked == [] and not (project / "a.txt").exists() and not (project / "b").exists()


def test_boundary_refusal_is_never_asked(project, store, tmp_path):
    (tmp_path / "secret.txt").write_text("s3cret")
    fe = Recorder([(True, "yes"), (True, "yes")])
    client = ScriptedClient([reply("", call("read", path="../secret.txt"),
                                   call("write", id="c2", path="/tmp/../" + str(tmp_path / "w.txt"), content="x")),
                             reply("ok")])
    agent = make(client, store, project, fe, mode=Mode.AUTO)
    asyncio.run(agent.run("go"))
    tools = [m for m in store.messages(agent.session.id) if m.role == "tool"]
    assert fe.asked == [] and all("s3cret" not in m.content for m in tools)
    assert not any(m.meta["ok"] for m in tools) and not (tmp_path / "w.txt").exists()


def test_non_interactive_runs_follow_allow_rules(project, store):
    client = ScriptedClient([reply("", call("shell", command="echo allowed > out.txt"),
                                   call("shell", id="c2", command="touch other.txt")), reply("ok")])
    agent = make(client, store, project, mode=Mode.ASK, interactive=False,
                 rules=(AllowRule.parse("shell:echo *"),))
    asyncio.run(agent.run("go"))
    assert (project / "out.txt").read_text().strip() == "allowed"
    assert not (project / "other.txt").exists()
    denied = [m for m in store.messages(agent.session.id) if m.role == "tool"][1]
    assert denied.approval["action"] == "deny"


def test_stop_during_the_reply_keeps_what_streamed(project, store):
    client = ScriptedClient([Hang("half an ans")])
    agent = make(client, store, project)

    async def go():
        task = asyncio.ensure_future(agent.run("long question"))
        await asyncio.sleep(0.05)
        agent.stop()
        return await asyncio.wait_for(task, 5)

    stats = asyncio.run(go())
    assert stats.stopped and client.cancelled == 1
    last = store.messages(agent.session.id)[-1]
    assert last.role == "assistant" and last.content == "half an ans" and last.meta["stopped"]


def test_stop_during_a_tool_kills_it_and_skips_the_rest(project, store):
    client = ScriptedClient([reply("", call("shell", command="sleep 30"), call("read", id="c2", path="app.py"))])
    agent = make(client, store, project, mode=Mode.AUTO)

    async def go():
        task = asyncio.ensure_future(agent.run("run it"))
        await asyncio.sleep(0.5)
        agent.stop()
        return await asyncio.wait_for(task, 10)

    t0 = time.monotonic()
    stats = asyncio.run(go())
    assert stats.stopped and time.monotonic() - t0 < 8
    tools = [m for m in store.messages(agent.session.id) if m.role == "tool"]
    assert len(tools) == 2 and tools[1].content == NOT_RUN
    # every call in the transcript has its result: the session resumes cleanly
    client2 = ScriptedClient([reply("resumed")])
    agent2 = Agent(client2, store, store.session(agent.session.id), project, AgentConfig(), Recorder())
    asyncio.run(agent2.run("continue"))
    sent = client2.requests[0]["messages"]
    ids = [c["id"] for m in sent if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert ids == ["c1", "c2"] and sum(m["role"] == "tool" for m in sent) == 2


def test_prompt_typed_during_work_is_added_between_rounds(project, store):
    agent = None

    def first(messages):
        agent.queue("also say bye")
        return reply("", call("read", path="app.py"))

    client = ScriptedClient([first, reply("hello and bye")])
    agent = make(client, store, project)
    asyncio.run(agent.run("say hello"))
    sent = client.requests[1]["messages"]
    assert sent[-1] == {"role": "user", "content": "also say bye"} and sent[-2]["role"] == "tool"


def test_queued_prompt_after_a_final_answer_gets_its_own_reply(project, store):
    agent = None

    def first(messages):
        agent.queue("one more thing")
        return reply("answer one")

    client = ScriptedClient([first, reply("answer two")])
    agent = make(client, store, project)
    stats = asyncio.run(agent.run("q"))
    assert stats.calls == 2 and roles(store, agent) == ["user", "assistant", "user", "assistant"]


def test_compaction_summarizes_the_head_and_keeps_the_tail(project, store):
    (project / "big.txt").write_text("\n".join(f"line {i} " + "x" * 60 for i in range(400)))
    script = [reply("", call("read", id=f"r{i}", path="big.txt", offset=1 + 60 * i, limit=60)) for i in range(6)]
    script.append(reply("done"))
    client = ScriptedClient(script, context=8192, summary="SUMMARY: read big.txt in six parts")
    agent = make(client, store, project, max_tokens=256)

    stats = asyncio.run(agent.run("read big.txt again and again"))
    assert stats.compactions >= 1 and stats.calls == 7
    markers = [m for m in store.messages(agent.session.id) if m.role == "marker"]
    assert len(markers) == stats.compactions
    summarize = next(r for r in client.requests if not r["tools"])
    assert "read big.txt again and again" in summarize["messages"][1]["content"]
    final = client.requests[-1]["messages"]
    assert final[1]["role"] == "user" and final[1]["content"].startswith(SUMMARY_HEADER)
    assert "SUMMARY: read big.txt in six parts" in final[1]["content"]
    assert "line 359 " in final[-1]["content"]                # the newest result is kept verbatim
    from lodestar.agent.context import estimate_tokens
    assert estimate_tokens(final, client.requests[-1]["tools"]) <= 8192 * 0.92 - 256
    # a rebuild after a restart sees the same: marker + tail
    again = Agent(ScriptedClient(context=8192, summary="S2"), store, store.session(agent.session.id), project, AgentConfig())
    assert asyncio.run(again.messages())[1]["content"].startswith(SUMMARY_HEADER)


def test_hard_limit_cuts_rendered_outputs_but_keeps_the_store(project, store):
    client = ScriptedClient(context=8192, summary="S")
    agent = make(client, store, project)
    store.add_message(agent.session.id, "user", "hi")
    store.add_message(agent.session.id, "assistant", "", tool_calls=[
        {"id": "x", "type": "function", "function": {"name": "read", "arguments": "{}"}}])
    store.add_message(agent.session.id, "tool", "y" * 40000, tool_call_id="x", name="read")
    store.add_message(agent.session.id, "user", "next")
    chat = asyncio.run(agent.messages())
    from lodestar.agent.context import estimate_tokens
    assert estimate_tokens(chat, agent.tools) <= int(8192 * 0.92) - 2048
    assert chat[-1] == {"role": "user", "content": "next"}
    assert len(store.messages(agent.session.id)[2].content) == 40000


def test_loop_runs_carry_the_report_and_stop_on_done(project, store):
    report1 = {"status": "continue", "summary": "made half", "next_steps": ["finish greet"]}
    report2 = {"status": "done", "summary": "finished", "next_steps": []}
    client = ScriptedClient([reply("worked"), reply(json.dumps(report1)), reply("worked more"),
                             reply(json.dumps(report2)), reply("never")])
    sessions = []

    def new_agent(r):
        s = store.create_session(str(project), "scripted", "ask")
        sessions.append(s.id)
        return Agent(client, store, s, project, AgentConfig(), Recorder())

    reports = asyncio.run(loop_run(new_agent, "fix greet", 5))
    assert [r.status for r in reports] == ["continue", "done"] and len(set(sessions)) == 2
    round2_prompt = client.requests[2]["messages"][-1]["content"]
    assert "made half" in round2_prompt and "finish greet" in round2_prompt
    assert len(client.requests[2]["messages"]) == 2          # fresh context: system + the round prompt
    assert client.requests[1]["response_format"]["json_schema"]["schema"]["required"] == \
        ["status", "summary", "next_steps"]


def test_loop_run_fails_on_an_invalid_report(project, store):
    client = ScriptedClient([reply("worked"), reply('{"status": "maybe"}'), reply("not json")])
    reports = asyncio.run(loop_run(
        lambda r: Agent(client, store, store.create_session(str(project), "s", "ask"), project, AgentConfig()),
        "task", 3))
    assert [r.status for r in reports] == ["failed"] and "schema" in reports[0].summary


def test_scripted_rm_rf_waits_for_the_deny_and_is_refused(project, store):
    (project / "src").mkdir()
    (project / "src" / "keep.py").write_text("x = 1\n")
    seen = {}

    class Slow(Recorder):
        async def approve(self, call, assessment, decision):
            seen["risks"] = set(assessment.risks)
            await asyncio.sleep(0.2)                  # the user thinks; nothing runs meanwhile
            seen["exists_while_asking"] = (project / "src" / "keep.py").exists()
            return False, "denied by the user: keep src"

    client = ScriptedClient([reply("", call("shell", command="rm -rf src")), reply("ok, I will not")])
    agent = make(client, store, project, Slow(), mode=Mode.AUTO)
    asyncio.run(agent.run("clean up"))
    assert "destructive" in seen["risks"] and seen["exists_while_asking"]
    assert (project / "src" / "keep.py").exists()
    sent = client.requests[1]["messages"][-1]
    assert sent["role"] == "tool" and "denied" in sent["content"] and "keep src" in sent["content"]


def test_stop_kills_background_jobs(project, store):
    client = ScriptedClient([reply("", call("shell", command="sleep 30 & echo started; wait", background=True)),
                             Hang("waiting for the job")])
    agent = make(client, store, project, mode=Mode.AUTO)

    async def go():
        task = asyncio.ensure_future(agent.run("start it"))
        await until_running(agent)
        import subprocess
        before = subprocess.run(["pgrep", "-f", "sleep 30 & echo started"], capture_output=True, text=True)
        assert before.stdout.strip(), "the background job is not running"
        agent.stop()
        return await asyncio.wait_for(task, 10)

    async def until_running(a):
        for _ in range(1000):
            if len(client.requests) == 2:            # the job started and the model is replying
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the job never started")

    stats = asyncio.run(go())
    assert stats.stopped
    import subprocess
    time.sleep(0.3)
    ps = subprocess.run(["pgrep", "-f", "sleep 30 & echo started"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", "the background job outlived Stop"


def test_compaction_on_a_1024_token_context(project, store):
    (project / "notes.txt").write_text("\n".join(f"note {i}: " + "y" * 40 for i in range(300)))
    script = [reply("", call("read", id=f"r{i}", path="notes.txt", offset=1 + 12 * i, limit=12)) for i in range(8)]
    script.append(reply("all read"))
    client = ScriptedClient(script, context=1024, summary="read notes.txt in parts")
    session = store.create_session(str(project), "scripted", "ask")
    agent = Agent(client, store, session, project, AgentConfig(max_tokens=128), Recorder(), tools=["read"],
                  spill_dir=project.parent / "spill")
    stats = asyncio.run(agent.run("read notes.txt"))
    assert stats.calls == 9 and stats.compactions >= 2
    from lodestar.agent.context import estimate_tokens
    for r in client.requests:
        if r["tools"]:                                # every real call held the hard limit
            assert estimate_tokens(r["messages"], r["tools"]) <= int(1024 * 0.92) - 128
    assert "note 95:" in client.requests[-1]["messages"][-1]["content"]


def test_agents_md_and_skills_reach_the_system_prompt_and_survive_compaction(project, store, tmp_path,
                                                                            monkeypatch):
    import argparse

    from lodestar.agent.app import Connection, build_agent
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    (project / "AGENTS.md").write_text("Always run ruff before committing.\n")
    (project / "AGENTS.local.md").write_text("Local: use tabs.\n")
    skill = project / ".agents" / "skills" / "release"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").write_text("---\nname: release\ndescription: cut a release tag\n---\nSteps...\n")
    client = ScriptedClient([reply("ok")], summary="S")
    a = argparse.Namespace(project=str(project), mode=None, allow=[], max_rounds=5, max_tokens=128, context=None,
                           shell_timeout=10.0, temperature=0.0, tool_choice="auto", tool_plan=None, tools=None,
                           resume=None)
    agent = build_agent(a, store, Connection(client, "scripted", None, 8192), Recorder())
    asyncio.run(agent.run("hi"))
    system = client.requests[0]["messages"][0]["content"]
    assert system.index("Always run ruff") < system.index("Local: use tabs.")
    assert "release" in system and "cut a release tag" in system and "SKILL.md" in system
    assert asyncio.run(agent.compact()) in (True, False)
    assert asyncio.run(agent.messages())[0]["content"] == system


@pytest.mark.parametrize("statuses, expected", [(["blocked"], ["blocked"]),
                                                (["continue", "continue", "continue"],
                                                 ["continue", "continue"])])
def test_loop_runs_stop_on_blocked_and_on_the_limit(project, store, statuses, expected):
    script = []
    for s in statuses:
        script += [reply("worked"), reply(json.dumps({"status": s, "summary": s, "next_steps": []}))]
    client = ScriptedClient(script)
    reports = asyncio.run(loop_run(
        lambda r: Agent(client, store, store.create_session(str(project), "s", "ask"), project, AgentConfig()),
        "task", 2))
    assert [r.status for r in reports] == expected


def test_forced_tool_plan_and_finish(project, store):
    client = ScriptedClient([reply("", call("write", path="a.txt", content="A")),
                             reply("", call("finish", id="f", message="all done"))])
    agent = make(client, store, project, mode=Mode.AUTO, tool_choice="required", tool_plan=("write",))
    stats = asyncio.run(agent.run("make a.txt"))
    assert stats.calls == 2 and (project / "a.txt").read_text() == "A"
    assert client.requests[0]["tools"][-1]["function"]["name"] == "finish"
    assert client.requests[0]["tool_choice"] == {"type": "function", "function": {"name": "write"}}
    assert client.requests[1]["tool_choice"] == "required"
    assert [m.content for m in store.messages(agent.session.id) if m.role == "tool"][-1] == "turn finished"
