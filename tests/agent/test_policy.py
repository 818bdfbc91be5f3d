import os
from pathlib import Path

import pytest

from lodestar.agent.policy import (
    AllowRule,
    Assessment,
    BoundaryError,
    Mode,
    ProjectBoundary,
    classify_shell,
    decide,
    scrubbed_env,
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("x = 1\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("s3cret\n")
    return root


@pytest.fixture
def boundary(project: Path) -> ProjectBoundary:
    return ProjectBoundary(project)


# -- boundary ------------------------------------------------------------------------------------
def test_relative_and_absolute_paths_inside_resolve(boundary, project):
    assert boundary.resolve("src/a.py") == project.resolve() / "src" / "a.py"
    assert boundary.resolve(str(project / "src" / "a.py")) == project.resolve() / "src" / "a.py"
    assert boundary.resolve("src/../src/a.py") == project.resolve() / "src" / "a.py"
    assert boundary.resolve("new/file.py", write=True) == project.resolve() / "new" / "file.py"
    assert boundary.relative(project / "src" / "a.py") == "src/a.py"
    assert boundary.relative(project) == "."


@pytest.mark.parametrize("path", ["../outside/secret.txt", "src/../../outside/secret.txt", "/etc/passwd",
                                  "~/.bashrc", "/proc/self/environ", "/dev/zero", "/sys/kernel", "a\x00b", ""])
@pytest.mark.parametrize("write", [False, True])
def test_paths_outside_or_special_are_refused(boundary, path, write):
    with pytest.raises(BoundaryError):
        boundary.resolve(path, write=write)


def test_symlink_pointing_out_is_refused_for_read_and_write(boundary, project, tmp_path):
    (project / "link.txt").symlink_to(tmp_path / "outside" / "secret.txt")
    (project / "linkdir").symlink_to(tmp_path / "outside")
    for write in (False, True):
        with pytest.raises(BoundaryError, match="outside the project"):
            boundary.resolve("link.txt", write=write)
        with pytest.raises(BoundaryError):
            boundary.resolve("linkdir/secret.txt", write=write)
    # a new file under a symlinked folder would land outside
    with pytest.raises(BoundaryError):
        boundary.resolve("linkdir/new/deeper.txt", write=True)
    # a dangling link to an outside path is refused too (writing would create the target)
    (project / "dangling").symlink_to(tmp_path / "outside" / "not-yet")
    with pytest.raises(BoundaryError):
        boundary.resolve("dangling", write=True)


def test_symlink_inside_the_project_is_followed(boundary, project):
    (project / "alias.py").symlink_to(project / "src" / "a.py")
    assert boundary.resolve("alias.py", write=True) == (project / "src" / "a.py").resolve()


def test_fifo_inside_the_project_is_refused(boundary, project):
    os.mkfifo(project / "pipe")
    with pytest.raises(BoundaryError, match="fifo"):
        boundary.resolve("pipe")


def test_extra_read_root_is_readable_not_writable(project, tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    (spill / "out.txt").write_text("x")
    b = ProjectBoundary(project, extra_read_roots=[spill])
    assert b.resolve(str(spill / "out.txt")) == (spill / "out.txt").resolve()
    with pytest.raises(BoundaryError):
        b.resolve(str(spill / "out.txt"), write=True)


def test_writes_into_dot_git_are_refused(boundary, project):
    (project / ".git").mkdir()
    with pytest.raises(BoundaryError, match=".git"):
        boundary.resolve(".git/hooks/pre-commit", write=True)
    assert boundary.resolve(".git/HEAD") == project.resolve() / ".git" / "HEAD"   # reading is fine


def test_root_must_be_a_folder(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        ProjectBoundary(tmp_path / "missing")


# -- classify_shell ------------------------------------------------------------------------------
SHELL_TABLE = [
    ("ls -la", set()),
    ("pytest -q tests/agent", set()),
    ("python x.py 2>&1 | tail -20", set()),
    ("make -j4 && echo ok", set()),
    ("cat src/a.py > copy.txt", set()),
    ("ls > /dev/null 2>&1", set()),
    ("export FOO=1; set -euo pipefail", set()),
    ("env FOO=1 python x.py", set()),
    ("git status && git diff HEAD~1", set()),
    ("rm -rf build", {"destructive"}),
    ("find . -name '*.pyc' -delete", {"destructive"}),
    ("find . -name '*.o' -exec rm {} \\;", {"destructive"}),
    ("echo hi > /etc/motd", {"destructive", "outside-path"}),
    ("chmod -R 777 .", {"destructive"}),
    ("ls; rm x", {"destructive"}),
    ("echo $(rm -rf src)", {"destructive"}),
    ("echo 'unbalanced", {"destructive"}),
    ("curl -s https://example.com", {"network"}),
    ("pip install requests", {"network"}),
    ("python -m pip install -e .", {"network"}),
    ("npm install left-pad", {"network"}),
    ("git clone https://github.com/x/y", {"network"}),
    ("bash -c 'wget http://x'", {"network"}),
    ("timeout 5 ssh host ls", {"network"}),
    ("sudo make install", {"privileged"}),
    ("kill -9 1", {"privileged"}),
    ("chown root file", {"privileged"}),
    ("cat /etc/passwd", {"outside-path"}),
    ("ls ..", {"outside-path"}),
    ("cd .. && ls", {"outside-path"}),
    ("cat ~/.ssh/id_rsa", {"credential", "outside-path"}),
    ("cat .env", {"credential"}),
    ("printenv", {"credential"}),
    ("env", {"credential"}),
    ("echo $OPENAI_API_KEY", {"credential"}),
    ("git reset --hard HEAD~1", {"vcs-rewrite"}),
    ("git push --force origin main", {"network", "vcs-rewrite"}),
    ("git commit --amend -m x", {"vcs-rewrite"}),
    ("git rebase -i HEAD~3", {"vcs-rewrite"}),
    ("git checkout -- .", {"vcs-rewrite"}),
    ("git clean -fdx", {"destructive", "vcs-rewrite"}),
    ("sudo apt-get install -y jq", {"privileged", "network"}),
]


@pytest.mark.parametrize("command,expected", SHELL_TABLE)
def test_classify_shell(boundary, command, expected):
    assert classify_shell(command, boundary) == frozenset(expected)


# -- decide --------------------------------------------------------------------------------------
READ = Assessment(kind="read", summary="read a")
META = Assessment(kind="meta")
WRITE = Assessment(kind="write", summary="write src/a.py", target="src/a.py")
SAFE_SHELL = Assessment(kind="shell", summary="shell: pytest -q")
NET_SHELL = Assessment(kind="shell", risks=frozenset({"network"}), summary="shell: curl x")
PRIV_SHELL = Assessment(kind="shell", risks=frozenset({"privileged"}), summary="shell: sudo pytest")
REFUSED = Assessment(kind="read", refused="/etc/passwd: outside the project")

DECIDE_TABLE = [
    # mode, tool, args, assessment, rules, expected action
    (Mode.READ_ONLY, "read", {"path": "a"}, READ, (), "allow"),
    (Mode.READ_ONLY, "todo", {"items": []}, META, (), "allow"),
    (Mode.READ_ONLY, "write", {"path": "src/a.py"}, WRITE, (), "deny"),
    (Mode.READ_ONLY, "shell", {"command": "pytest -q"}, SAFE_SHELL, ("shell",), "deny"),
    (Mode.READ_ONLY, "read", {"path": "/etc/passwd"}, REFUSED, (), "deny"),
    (Mode.ASK, "read", {"path": "a"}, READ, (), "allow"),
    (Mode.ASK, "write", {"path": "src/a.py"}, WRITE, (), "ask"),
    (Mode.ASK, "write", {"path": "src/a.py"}, WRITE, ("write:src/**",), "allow"),
    (Mode.ASK, "write", {"path": "src/a.py"}, WRITE, ("write:docs/**",), "ask"),
    (Mode.ASK, "shell", {"command": "pytest -q"}, SAFE_SHELL, (), "ask"),
    (Mode.ASK, "shell", {"command": "pytest -q"}, SAFE_SHELL, ("shell:pytest*",), "allow"),
    (Mode.ASK, "shell", {"command": "pytest -q; rm -rf x"}, SAFE_SHELL, ("shell:pytest*",), "ask"),
    (Mode.ASK, "read", {"path": "/etc/passwd"}, REFUSED, ("shell",), "deny"),
    (Mode.AUTO, "write", {"path": "src/a.py"}, WRITE, (), "allow"),
    (Mode.AUTO, "shell", {"command": "pytest -q"}, SAFE_SHELL, (), "allow"),
    (Mode.AUTO, "shell", {"command": "curl x"}, NET_SHELL, (), "ask"),
    (Mode.AUTO, "shell", {"command": "curl x"}, NET_SHELL, ("shell:curl*",), "allow"),
    (Mode.AUTO, "shell", {"command": "sudo pytest"}, PRIV_SHELL, ("shell",), "ask"),
    (Mode.AUTO, "shell", {"command": "sudo pytest"}, PRIV_SHELL, ("shell:sudo*",), "ask"),
]


@pytest.mark.parametrize("mode,tool,args,assessment,rules,expected", DECIDE_TABLE)
def test_decide(mode, tool, args, assessment, rules, expected):
    decision = decide(mode, tool, args, assessment, [AllowRule.parse(r) for r in rules])
    assert decision.action == expected, decision.reason
    assert decision.reason


def test_decide_refused_reason_is_the_boundary_message():
    decision = decide(Mode.AUTO, "read", {"path": "/etc/passwd"}, REFUSED)
    assert decision == decide(Mode.AUTO, "read", {}, REFUSED)
    assert "outside the project" in decision.reason


def test_non_interactive_turns_ask_into_deny_naming_the_rule():
    d = decide(Mode.ASK, "shell", {"command": "pytest -q tests"}, SAFE_SHELL, interactive=False)
    assert d.action == "deny" and "--allow 'shell:pytest*'" in d.reason
    d = decide(Mode.ASK, "write", {"path": "src/a.py"}, WRITE, interactive=False)
    assert d.action == "deny" and "--allow 'write:src/a.py'" in d.reason
    # with a matching rule the call runs without anyone to ask
    d = decide(Mode.ASK, "shell", {"command": "pytest -q tests"}, SAFE_SHELL, [AllowRule.parse("shell:pytest*")],
               interactive=False)
    assert d.action == "allow" and "shell:pytest*" in d.reason
    # privileged can never be allowed by a rule, so no rule is suggested
    d = decide(Mode.AUTO, "shell", {"command": "sudo pytest"}, PRIV_SHELL, [AllowRule.parse("shell")],
               interactive=False)
    assert d.action == "deny" and "--allow '" not in d.reason
    # allowed things stay allowed
    assert decide(Mode.AUTO, "shell", {"command": "ls"}, SAFE_SHELL, interactive=False).action == "allow"


def test_write_rule_matches_the_normalized_path_from_the_assessment():
    rule = AllowRule.parse("write:src/**")
    # the model wrote an absolute path; the assessment carries the project-relative one
    assert decide(Mode.ASK, "write", {"path": "/abs/proj/src/a.py"}, WRITE, [rule]).action == "allow"
    assert rule.matches("write", {"path": "./src/x/y.py"})
    assert not rule.matches("edit", {"path": "src/a.py"})
    assert not rule.matches("write", {"path": "docs/a.md"})


@pytest.mark.parametrize("command,allowed", [
    ("pytest -q", True),
    ("pytest -q 2>&1 | tail -20", True),
    ("pytest -q && pytest -x", True),
    ("pytest -q && rm -rf /", False),
    ("pytest $(rm -rf x)", False),
    ("pytest > /etc/x", False),
    ("rm -rf x; pytest", False),
    ("echo 'unbalanced", False),
])
def test_shell_rule_covers_every_command_of_a_line(command, allowed):
    assert AllowRule.parse("shell:pytest*").matches("shell", {"command": command}) is allowed


@pytest.mark.parametrize("text,tool,pattern", [
    ("shell", "shell", None), ("shell:pytest*", "shell", "pytest*"), ("write:src/**", "write", "src/**"),
    ("edit", "edit", None), (" edit:docs/* ", "edit", "docs/*"),
])
def test_allow_rule_parse(text, tool, pattern):
    assert AllowRule.parse(text) == AllowRule(tool, pattern)


@pytest.mark.parametrize("text", ["", "rm", "shell:", "read:src/**", "bash:ls"])
def test_allow_rule_parse_rejects_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match="accepted forms: 'shell'"):
        AllowRule.parse(text)


# -- environment ---------------------------------------------------------------------------------
def test_scrubbed_env_keeps_only_safe_names():
    parent = {"PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "LC_ALL": "C", "TERM": "xterm",
              "OPENAI_API_KEY": "sk-1", "ANTHROPIC_API_KEY": "a", "GITHUB_TOKEN": "g", "AWS_SECRET_ACCESS_KEY": "x",
              "HF_TOKEN": "h", "SSH_AUTH_SOCK": "/tmp/s", "PYTHONPATH": "/x", "DATABASE_PASSWORD": "p",
              "MY_SERVICE_AUTH": "t", "RANDOM_VAR": "r"}
    env = scrubbed_env(parent)
    for kept in ("PATH", "HOME", "LANG", "LC_ALL", "TERM"):
        assert env[kept] == parent[kept]
    for dropped in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN",
                    "SSH_AUTH_SOCK", "PYTHONPATH", "DATABASE_PASSWORD", "MY_SERVICE_AUTH", "RANDOM_VAR"):
        assert dropped not in env
    assert env["GIT_TERMINAL_PROMPT"] == "0" and env["PAGER"] == "cat"


def test_scrubbed_env_defaults_to_the_process_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    env = scrubbed_env()
    assert "OPENAI_API_KEY" not in env and env["PATH"] == os.environ["PATH"]
