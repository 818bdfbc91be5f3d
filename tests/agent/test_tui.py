"""The interactive terminal session driven through a pipe: approvals answered at the prompt,
Ctrl+C stopping a run, lines typed during a run queued, Ctrl+D quitting."""
from __future__ import annotations

import asyncio

import pytest
from prompt_toolkit.application import create_app_session
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from lodestar.agent.loop import Agent, AgentConfig
from lodestar.agent.policy import Mode
from lodestar.agent.store import AgentStore
from lodestar.agent.tui import TerminalFrontend, interactive
from tests.agent.scripted import Hang, ScriptedClient, call, reply


class Screen(TerminalFrontend):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def say(self, text, style=""):
        self.lines.append(text)


async def until(cond, timeout=10.0):
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.fixture
def setup(tmp_path):
    root = tmp_path / "p"
    root.mkdir()
    store = AgentStore(tmp_path / "a.db")
    yield root, store
    store.close()


def drive(agent, screen, script):
    async def go():
        with create_pipe_input() as inp, create_app_session(input=inp, output=DummyOutput()):
            session = asyncio.ensure_future(interactive(agent, "banner"))
            await script(inp)
            inp.send_text("\x04")                    # Ctrl+D: quit
            return await asyncio.wait_for(session, 10)
    return asyncio.run(go())


def test_approval_is_answered_at_the_prompt(setup):
    root, store = setup
    client = ScriptedClient([reply("", call("write", path="a.txt", content="hi\n")), reply("wrote it")])
    agent = Agent(client, store, store.create_session(str(root), "m", "ask"), root, AgentConfig(mode=Mode.ASK),
                  screen := Screen())

    async def script(inp):
        inp.send_text("make a.txt\n")
        await until(lambda: screen.pending is not None)
        inp.send_text("y\n")
        await until(lambda: any("model calls" in l for l in screen.lines))

    assert drive(agent, screen, script) == 0
    assert (root / "a.txt").read_text() == "hi\n"
    assert any(l.startswith("? approve") for l in screen.lines) and "wrote it" in screen.lines


def test_ctrl_c_stops_the_run_and_typed_lines_are_queued(setup):
    root, store = setup
    agent = None

    def first(messages):
        return reply("", call("read", path="."))

    client = ScriptedClient([first, Hang("thinking")])
    agent = Agent(client, store, store.create_session(str(root), "m", "ask"), root, AgentConfig(),
                  screen := Screen())

    async def script(inp):
        inp.send_text("look around\n")
        await until(lambda: client.requests and len(client.requests) == 2)
        inp.send_text("\x03")                        # Ctrl+C during the reply
        await until(lambda: any(l.startswith("stopped") for l in screen.lines))

    drive(agent, screen, script)
    assert client.cancelled == 1
    assert store.messages(agent.session.id)[-1].meta.get("stopped")
