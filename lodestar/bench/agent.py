"""``lodestar bench agent``: what a coding session waits for, through the agent's whole path
(Agent -> HTTP on the in-process socket -> engine).

A stored session (the agent's system prompt and tools, a request, a ``read`` of a
150-line file and an answer: about 3,000 tokens) gets new prompts, each answered with a few
tokens (time to first token is the point):

1. cold: the first call of a fresh engine (the whole conversation prefilled);
2. second turn: the next prompt on the same engine (the prefix cache holds the rest);
3. after restart: the next prompt on a fresh engine over the same disk KV folder, as when
   ``lodestar agent --resume`` starts a new process;
4. restart without the disk tier: the same, with no checkpoint folder (the context is
   rebuilt from the transcript: one full prefill).

Median [min–max] of ``--runs``, every run on fresh engines, after one warm-up run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import torch

from lodestar.bench.common import Stat, device_info, git_commit
from lodestar.bench.spec_workloads import INVENTORY_PY

PHASES = ("cold", "second_turn", "restart_disk", "restart_no_disk")


def _seed(store, project: Path) -> str:
    """A session whose transcript holds a request, a read of inventory.py and an answer."""
    (project / "inventory.py").write_text(INVENTORY_PY)
    s = store.create_session(str(project), "bench", "ask")
    store.add_message(s.id, "user", "Explain what inventory.py does.")
    call = {"id": "call_read", "type": "function", "function": {"name": "read",
                                                                  "arguments": '{"path": "inventory.py"}'}}
    store.add_message(s.id, "assistant", "", tool_calls=[call])
    numbered = "\n".join(f"{i:>5}\t{line}" for i, line in enumerate(INVENTORY_PY.splitlines(), 1))
    store.add_message(s.id, "tool", numbered, tool_call_id="call_read", name="read", meta={"ok": True})
    store.add_message(s.id, "assistant", "It loads stock records from a CSV file, restocks items below "
                                         "their reorder level and reports the value of the stock.")
    return s.id


class _Served:
    """One engine behind the app on a private socket, and an agent client for it."""

    def __init__(self, loaded, kv_dir: str | None) -> None:
        from lodestar.agent.client import ChatClient
        from lodestar.engine.async_engine import AsyncLLMEngine
        from lodestar.engine.llm_engine import EngineConfig, LLMEngine
        from lodestar.serve import LocalServer, ServeConfig, build_app
        self.aeng = AsyncLLMEngine(lambda: LLMEngine(loaded, EngineConfig(max_num_seqs=4, kv_dir=kv_dir)))
        self.server = LocalServer(build_app(self.aeng, ServeConfig(model_names=("bench",)))).start()
        self.client = ChatClient(self.server.base_url, "bench", transport=self.server.client_transport())

    def close(self) -> None:
        self.server.stop()
        self.aeng.shutdown()


def _turn(served: _Served, store, sid: str, project: Path, prompt: str) -> dict:
    from lodestar.agent.loop import Agent, AgentConfig

    async def go():
        try:
            agent = Agent(served.client, store, store.session(sid), project,
                          AgentConfig(max_rounds=1, max_tokens=4, temperature=0.0))
            return await agent.run(prompt)
        finally:
            await served.client.aclose()

    stats = asyncio.run(go())
    served.client = type(served.client)(served.server.base_url, "bench",
                                        transport=served.server.client_transport())
    return {"ttft_ms": 1000 * (stats.first_ttft_s or float("nan")), "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens}


def run_once(loaded, root: Path) -> dict:
    from lodestar.agent.store import AgentStore
    project, kv = root / "project", root / "kv"
    project.mkdir(parents=True)
    store = AgentStore(root / "agent.db")
    try:
        sid = _seed(store, project)
        out = {}
        served = _Served(loaded, str(kv))
        try:
            out["cold"] = _turn(served, store, sid, project, "Which function restocks items?")
            out["second_turn"] = _turn(served, store, sid, project, "And which one saves the inventory?")
        finally:
            served.close()                      # as the agent exits: checkpoints reach the disk
        served = _Served(loaded, str(kv))
        try:
            out["restart_disk"] = _turn(served, store, sid, project, "What currency does it use?")
        finally:
            served.close()
        served = _Served(loaded, None)
        try:
            out["restart_no_disk"] = _turn(served, store, sid, project, "What is the default reorder level?")
        finally:
            served.close()
        return out
    finally:
        store.close()


def main(a: argparse.Namespace) -> int:
    from lodestar.engine.loader import load_model
    if a.threads:
        torch.set_num_threads(a.threads)
    loaded = load_model(a.model, mode=a.dtype, progress=False, device=a.device)
    res = {k: Stat() for k in PHASES}
    tokens: dict[str, dict] = {}
    for r in range(a.runs + 1):
        root = Path(tempfile.mkdtemp(prefix="lodestar-bench-agent-"))
        try:
            once = run_once(loaded, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        label = "warm-up" if r == 0 else f"run {r}/{a.runs}"
        print(f"  {label}: " + ", ".join(f"{k} {v['ttft_ms']:.0f} ms ({v['cached_tokens']}/{v['prompt_tokens']} "
                                         f"cached)" for k, v in once.items()), flush=True)
        if r == 0:
            continue
        for k, v in once.items():
            res[k].add(v["ttft_ms"])
            tokens[k] = {"prompt_tokens": v["prompt_tokens"], "cached_tokens": v["cached_tokens"]}
    cold = res["cold"].median
    print(f"\nagent turn, time to first token: {loaded.path.name} ({a.dtype}) on {loaded.device}, "
          f"{torch.get_num_threads()} threads, median [min–max] of {a.runs}")
    print(f"{'':<34}{'ms':>24}{'prompt':>8}{'cached':>8}{'vs cold':>9}")
    names = {"cold": "cold (fresh engine)", "second_turn": "second turn (prefix cache)",
             "restart_disk": "after restart (disk tier)", "restart_no_disk": "after restart, no disk tier"}
    for k in PHASES:
        t = tokens[k]
        print(f"{names[k]:<34}{res[k].fmt(0):>24}{t['prompt_tokens']:>8}{t['cached_tokens']:>8}"
              f"{cold / res[k].median:>8.2f}x")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"bench": "agent", "model": loaded.path.name, "dtype": a.dtype,
                                      "device": device_info(), "commit": git_commit(), "runs": a.runs,
                                      "results": {k: {**res[k].as_dict(), **tokens[k]} for k in PHASES}},
                                     indent=1) + "\n")
    return 0
