"""Refresh tests/clients/fixtures/: what each real client sends, captured against the fake server.

    .venv/bin/python tests/clients/capture_fixtures.py            # all clients
    .venv/bin/python tests/clients/capture_fixtures.py codex aider

Runs each installed client (tests/clients/install_clients.sh) against capture_server.py in
fake mode, for three cases, and writes one file per client and case:

- ``<client>-docs.json``: the settings docs/serving.md gives, the client's defaults otherwise
  ("Reply with the word hello"). Every request of the run, a title request included.
- ``<client>-small.json``: the short-prompt settings test_real_clients.py uses.
- ``<client>-tool-result.json``: the small settings on the tool task; the fake server calls the
  client's file-reading tool once, and the file holds the request that carries its result.

Each file: {"client", "version", "case", "settings", "requests": [{"method", "path", "query",
"headers", "body"}]}, headers without Host and Content-Length.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import clients
from capture_server import CaptureConfig, CaptureServer

FIXTURES = Path(__file__).with_name("fixtures")
HELLO = "Reply with the word hello"
TOOL_TASK = "What is the secret word in hello.txt? Read the file with your tool."
DROP_HEADERS = {"host", "content-length"}


def _invocation(name: str, case: str, url: str, project: Path, home: Path):
    if case == "docs":
        return clients.BUILDERS[name](url, project, home, HELLO, profile="docs")
    if case == "small":
        return clients.BUILDERS[name](url, project, home, HELLO, profile="small")
    if name == "claude":
        return clients.claude(url, project, home, TOOL_TASK, tools="Read")
    if name == "opencode":
        return clients.opencode(url, project, home, TOOL_TASK, tools=("read",))
    return clients.BUILDERS[name](url, project, home, TOOL_TASK)


def _has_tool_result(body) -> bool:
    text = json.dumps(body)
    return any(k in text for k in ('"function_call_output"', '"tool_result"', '"role": "tool"'))


def capture(name: str, case: str, version: str, work: Path) -> Path | None:
    project = clients.make_project(work / f"{name}-{case}" / "project")
    server = CaptureServer(CaptureConfig(log_dir=work / f"{name}-{case}" / "log", tool_calls=case == "tool-result",
                                         workdir=str(project))).start_in_thread()
    try:
        inv = _invocation(name, case, server.url, project, work / f"{name}-{case}" / "home")
        result = clients.run(inv, timeout=180)
    finally:
        server.shutdown()
    requests = [e for e in server.entries if e["method"] != "GET" or e["path"] != "/health"]
    if case == "tool-result":
        requests = [e for e in requests if _has_tool_result(e["body"])][:1]
    print(f"{name}-{case}: exit {result.returncode} in {result.seconds:.1f} s, {len(requests)} request(s) kept")
    if not requests:
        print(result.describe())
        return None
    out = FIXTURES / f"{name}-{case}.json"
    settings = {"argv": [Path(inv.argv[0]).name, *inv.argv[1:]],
                "env": {k: v for k, v in inv.env.items() if k.startswith(("ANTHROPIC_", "CLAUDE_CODE_", "OPENAI_"))}}
    for cfg in ("config.toml", "instructions.md"):
        if (inv.env.get("CODEX_HOME") and (p := Path(inv.env["CODEX_HOME"]) / cfg).exists()):
            settings[cfg] = p.read_text()
    if (p := project / "opencode.json").exists():
        settings["opencode.json"] = json.loads(p.read_text())
    out.write_text(json.dumps({
        "client": name, "version": version, "case": case, "settings": settings,
        "requests": [{"method": e["method"], "path": e["path"], "query": e["query"],
                      "headers": {k: v for k, v in e["headers"].items() if k.lower() not in DROP_HEADERS},
                      "body": e["body"]} for e in requests],
    }, indent=1, ensure_ascii=False) + "\n")
    return out


def main(argv: list[str]) -> int:
    names = argv or list(clients.BINARIES)
    missing = clients.ensure_installed(names)
    for n, why in missing.items():
        print(f"{n}: not installed ({why})")
    versions = clients.installed_versions()
    FIXTURES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lodestar-capture-") as tmp:
        for name in names:
            if name not in versions:
                continue
            for case in ("docs", "small", "tool-result"):
                if case == "tool-result" and name == "aider":
                    continue  # aider declares no tools: its edits are text in the reply
                capture(name, case, versions[name], Path(tmp))
    total = sum(p.stat().st_size for p in FIXTURES.glob("*.json"))
    print(f"fixtures: {total / 1024:.0f} KiB in {FIXTURES}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
