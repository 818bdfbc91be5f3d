"""How the real coding clients are installed, configured and run against a server.

Used by test_real_clients.py (against `lodestar serve`) and capture_fixtures.py (against
the capture server, to refresh tests/clients/fixtures/). Each client runs with its own
throwaway home/config folder, pointed at ``base_url`` only, with telemetry, update checks
and other calls home switched off.

Two configurations per client:

- ``docs``: the settings docs/serving.md gives (Codex's config.toml, Claude Code's
  environment, opencode's opencode.json), otherwise the client's defaults. Their prompts are
  thousands of tokens (Claude Code's and Codex's exceed the default model's 8,192 context).
- ``small``: the client's own switches that shorten its prompt (short system prompt, few
  tools, small output cap), so that a request fits the 135M default model and answers fast.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_DIR = Path(os.environ.get("LODESTAR_CLIENTS_DIR", ROOT / ".clients"))
INSTALL_SCRIPT = Path(__file__).with_name("install_clients.sh")
NODE_BIN = CLIENTS_DIR / "node" / "node_modules" / ".bin"
BINARIES = {
    "codex": NODE_BIN / "codex",
    "claude": NODE_BIN / "claude",
    "opencode": NODE_BIN / "opencode",
    "aider": CLIENTS_DIR / "aider-venv" / "bin" / "aider",
}
MODEL = "smollm2-135m"
# The file the tool round-trip task asks about; the clients read it with their own tool.
SECRET_FILE, SECRET_TEXT = "hello.txt", "The secret word is pineapple.\n"

# Switched off for every client: no telemetry, update checks, error reports or feedback.
QUIET_ENV = {
    "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_CLAUDE_CODE": "1", "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True", "AIDER_ANALYTICS": "false", "AIDER_CHECK_UPDATE": "false",
    "npm_config_update_notifier": "false", "NO_COLOR": "1", "TERM": "dumb",
}


def installed_versions() -> dict[str, str]:
    """{client: pinned spec} for the clients install_clients.sh has installed."""
    stamps = CLIENTS_DIR / "stamps"
    return {name: (stamps / name).read_text().strip() for name in BINARIES
            if (stamps / name).is_file() and BINARIES[name].exists()}


def ensure_installed(names: list[str], timeout: float = 600) -> dict[str, str]:
    """Install what is missing with install_clients.sh; returns {client: why it is unavailable}."""
    missing = [n for n in names if n not in installed_versions()]
    if not missing:
        return {}
    try:
        proc = subprocess.run(["bash", str(INSTALL_SCRIPT), *missing], capture_output=True, text=True, check=False,
                              timeout=timeout, env={**os.environ, "LODESTAR_CLIENTS_DIR": str(CLIENTS_DIR)})
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        # the script's own line about a client ("aider: PyPI is unreachable"), else its last lines
        why = {n: next((ln for ln in lines if ln.startswith(f"{n}: ")),
                       f"install_clients.sh exited {proc.returncode}: " + " | ".join(lines[-3:])) for n in missing}
    except subprocess.TimeoutExpired:
        why = dict.fromkeys(missing, f"install_clients.sh took more than {timeout:.0f} s")
    have = installed_versions()
    return {n: why[n] for n in missing if n not in have}


@dataclass
class Invocation:
    argv: list[str]
    env: dict[str, str]
    cwd: Path


@dataclass
class Result:
    returncode: int | None   # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    argv: list[str] = field(default_factory=list)

    def describe(self) -> str:
        rc = "killed at the timeout" if self.returncode is None else f"exit {self.returncode}"
        return (f"{' '.join(self.argv[:3])} ...: {rc} after {self.seconds:.1f} s\n"
                f"--- stdout (tail)\n{self.stdout[-3000:]}\n--- stderr (tail)\n{self.stderr[-3000:]}")


def run(inv: Invocation, timeout: float, stop_when: Callable[[], bool] | None = None) -> Result:
    """Run a client in its own process group. The whole group is killed at the timeout
    (opencode ignores SIGTERM while it waits on a stream), or as soon as ``stop_when()``
    holds (polled twice a second); either way ``returncode`` is None."""
    t0 = time.monotonic()
    env = inv.env | {"PWD": str(inv.cwd)}  # opencode takes its project folder from $PWD, not the cwd
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(inv.argv, cwd=inv.cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, text=True, start_new_session=True)
        rc = None
        while time.monotonic() - t0 < timeout:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop_when is not None and stop_when():
                    break
        if rc is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:  # whatever the client left running in its group (a tool's shell) goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.seek(0)
        err.seek(0)
        return Result(rc, out.read(), err.read(), time.monotonic() - t0, inv.argv)


def make_project(path: Path) -> Path:
    """A tiny git project with the file the tool task asks about."""
    path.mkdir(parents=True, exist_ok=True)
    (path / SECRET_FILE).write_text(SECRET_TEXT)
    git = ["git", "-c", "user.email=test@example.invalid", "-c", "user.name=test"]
    subprocess.run([*git, "init", "-q"], cwd=path, check=True)
    subprocess.run([*git, "add", "."], cwd=path, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=path, check=True)
    return path


def _base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "ANTHROPIC_", "CLAUDE", "CODEX_", "OPENCODE", "AIDER_"))}
    env.update(QUIET_ENV)
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"),
               # npm packages a client fetches at run time (opencode's plugin) come from this cache next time
               npm_config_cache=str(CLIENTS_DIR / "npm-cache"))
    return env


# -- Codex CLI -----------------------------------------------------------------------------
CODEX_SMALL_INSTRUCTIONS = (
    "You are a coding assistant. Answer in one short sentence. To read a file, call the "
    "exec_command tool with cmd set to a shell command such as: cat hello.txt")


def codex(base_url: str, project: Path, home: Path, prompt: str, profile: str = "small") -> Invocation:
    home.mkdir(parents=True, exist_ok=True)
    lines = [f'model = "{MODEL}"', 'model_provider = "lodestar"']
    if profile == "small":
        (home / "instructions.md").write_text(CODEX_SMALL_INSTRUCTIONS + "\n")
        lines += [f'model_instructions_file = "{home / "instructions.md"}"',
                  "model_context_window = 8192", 'model_reasoning_summary = "none"',
                  'web_search = "disabled"', "project_doc_max_bytes = 0"]
    lines += ["check_for_update_on_startup = false", "", "[analytics]", "enabled = false", ""]
    if profile == "small":
        lines += ["[features]", "goals = false", "apps = false", "plugins = false", "image_generation = false",
                  "skill_search = false", "shell_snapshot = false", "",
                  "[agents]", "enabled = false", "", "[skills]", "include_instructions = false", ""]
    lines += ["[model_providers.lodestar]", 'name = "lodestar"', f'base_url = "{base_url}/v1"',
              'wire_api = "responses"']
    if profile == "small":  # a failed stream is reported at once, not retried five times
        lines += ["request_max_retries = 0", "stream_max_retries = 0"]
    (home / "config.toml").write_text("\n".join(lines) + "\n")
    env = _base_env(home) | {"CODEX_HOME": str(home)}
    argv = [str(BINARIES["codex"]), "exec", "--skip-git-repo-check", "--sandbox", "read-only", prompt]
    return Invocation(argv, env, project)


# -- Claude Code ---------------------------------------------------------------------------
CLAUDE_SMALL_SYSTEM = ("You are a helpful assistant. Answer in one short sentence. "
                       "To read a file, call the Read tool with its absolute file_path.")


def claude(base_url: str, project: Path, home: Path, prompt: str, profile: str = "small",
           tools: str = "") -> Invocation:
    home.mkdir(parents=True, exist_ok=True)
    env = _base_env(home) | {
        "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_AUTH_TOKEN": "unused", "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4096" if profile == "docs" else "160",
    }
    argv = [str(BINARIES["claude"]), "-p", prompt]  # the prompt first: --tools and --allowedTools take lists
    if profile == "small":
        argv += ["--bare", "--no-session-persistence", "--system-prompt", CLAUDE_SMALL_SYSTEM, "--tools", tools]
        if tools:
            argv += ["--allowedTools", tools]
    return Invocation(argv, env, project)


# -- opencode ------------------------------------------------------------------------------
OPENCODE_SMALL_PROMPT = ("You are a helpful assistant. Answer in one short sentence. "
                         "To read a file, call the read tool with its absolute filePath.")
OPENCODE_TOOLS = ("bash", "edit", "glob", "grep", "read", "skill", "task", "todowrite", "webfetch", "write")


def opencode(base_url: str, project: Path, home: Path, prompt: str, profile: str = "small",
             tools: tuple[str, ...] = ()) -> Invocation:
    home.mkdir(parents=True, exist_ok=True)
    output = 2048 if profile == "docs" else 128
    config: dict = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"lodestar": {
            "npm": "@ai-sdk/openai-compatible", "name": "lodestar",
            "options": {"baseURL": f"{base_url}/v1"},
            "models": {MODEL: {"name": "SmolLM2 135M", "limit": {"context": 8192, "output": output}}}}},
        "model": f"lodestar/{MODEL}",
    }
    if profile == "small":
        # "temperature": true lets the agent's temperature through (opencode drops it for a model without)
        config["provider"]["lodestar"]["models"][MODEL]["temperature"] = True
        config["small_model"] = f"lodestar/{MODEL}"
        config["agent"] = {"build": {"prompt": OPENCODE_SMALL_PROMPT, "temperature": 0}, "title": {"disable": True}}
        config["tools"] = {t: t in tools for t in OPENCODE_TOOLS}
    (project / "opencode.json").write_text(json.dumps(config, indent=2))
    return Invocation([str(BINARIES["opencode"]), "run", prompt], _base_env(home), project)


# -- aider ---------------------------------------------------------------------------------
def aider(base_url: str, project: Path, home: Path, prompt: str, profile: str = "small") -> Invocation:
    home.mkdir(parents=True, exist_ok=True)
    # Known to aider from this file, so it does not fetch litellm's model list from the web.
    meta = home / "model-metadata.json"
    meta.write_text(json.dumps({f"openai/{MODEL}": {
        "max_input_tokens": 8192, "max_output_tokens": 512, "max_tokens": 8192, "input_cost_per_token": 0,
        "output_cost_per_token": 0, "litellm_provider": "openai", "mode": "chat"}}))
    argv = [str(BINARIES["aider"]), "--model", f"openai/{MODEL}", "--model-metadata-file", str(meta),
            "--message", prompt, "--yes-always", "--no-check-update", "--analytics-disable",
            "--no-show-release-notes", "--no-auto-commits", "--no-gitignore", "--no-pretty",
            "--no-show-model-warnings"]
    if profile == "small":
        settings = home / "model-settings.yml"
        settings.write_text(f"- name: openai/{MODEL}\n  edit_format: whole\n  extra_params:\n    max_tokens: 128\n")
        argv += ["--model-settings-file", str(settings), "--map-tokens", "0", "--edit-format", "ask"]
    env = _base_env(home) | {"OPENAI_API_BASE": f"{base_url}/v1", "OPENAI_API_KEY": "unused"}
    return Invocation(argv, env, project)


BUILDERS = {"codex": codex, "claude": claude, "opencode": opencode, "aider": aider}
