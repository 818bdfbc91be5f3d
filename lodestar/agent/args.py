"""The agent's command-line options, in a module light enough to import whenever the parser is
built (the agent itself loads only when `lodestar agent` runs)."""
from __future__ import annotations

import argparse
from pathlib import Path

from lodestar.agent.policy import Mode
from lodestar.agent.store import default_db_path


def add_agent_args(p: argparse.ArgumentParser) -> None:
    """Options shared by `agent`, `agent loop` (the model options are added by the caller)."""
    p.add_argument("--project", "-C", default=".", help="the project folder the agent works in (default: .)")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=None,
                   help="read-only: no writes or shell; ask (default): writes and shell need approval; "
                        "auto: safe writes and commands run, risky ones ask")
    p.add_argument("--allow", action="append", default=[], metavar="RULE",
                   help="allow matching calls without asking, e.g. 'shell:pytest*', 'edit', 'write:src/**' "
                        "(repeatable; non-interactive runs deny everything else that would ask)")
    p.add_argument("--db", type=Path, default=None, help=f"session store (default {default_db_path()})")
    p.add_argument("--base-url", default=None,
                   help="use an OpenAI-compatible server instead of the local engine, e.g. http://gpu-box:8000/v1")
    p.add_argument("--api-key", default=None, help="with --base-url: its API key (default $LODESTAR_API_KEY)")
    p.add_argument("--served-model", default=None, help="with --base-url: the model name to ask for "
                   "(default: the server's first)")
    p.add_argument("--max-rounds", type=int, default=40, help="most model calls per prompt (default 40)")
    p.add_argument("--max-tokens", type=int, default=2048, help="most tokens per reply (default 2048)")
    p.add_argument("--temperature", type=float, default=0.2,
                   help="sampling temperature of the agent's calls (default 0.2: tool calls want little noise)")
    p.add_argument("--tools", default=None, metavar="LIST",
                   help="comma-separated tools the model gets (default all: read,write,edit,list,glob,grep,git,"
                        "shell,job_output,job_kill,todo); fewer tools leave small models more context and fewer "
                        "ways to go wrong")
    p.add_argument("--tool-choice", choices=["auto", "required"], default="auto",
                   help="required: every reply is one tool call, forced by the server's grammar, and a `finish` "
                        "tool ends the turn (lets small local models act reliably; default auto)")
    p.add_argument("--tool-plan", default=None, metavar="LIST",
                   help="comma-separated tools the first replies of each prompt must call, in order (the model "
                        "writes the arguments), e.g. write,shell,finish: a fixed workflow a small model can follow")
    p.add_argument("--context", type=int, default=None,
                   help="context tokens to plan compaction for (default: what the server reports)")
    p.add_argument("--shell-timeout", type=float, default=120.0, help="seconds a shell command may run (default 120)")
