"""The agent's safety policy: where it may read and write (``ProjectBoundary``), how risky a
shell command looks (``classify_shell``), and whether a tool call runs, asks or is denied
(``decide``) under a mode and the user's ``--allow`` rules.

The boundary is a hard wall: a path outside the project is refused and no approval can let
it through. Risk classes are advisory and conservative: they decide when to ask, and a
command that cannot be understood is treated as risky.
"""
from __future__ import annotations

import fnmatch
import itertools
import os
import re
import shlex
import stat
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterable, Mapping, Sequence


class BoundaryError(Exception):
    """A path outside the project (or a special file): refused, never approvable."""


# Kernel pseudo-filesystems: reading them leaks the environment or never ends.
_SPECIAL_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))


class ProjectBoundary:
    """The project folder the agent works in, plus folders it may only read (spill files)."""

    def __init__(self, root: str | Path, extra_read_roots: Iterable[Path] = ()) -> None:
        real = Path(os.path.realpath(os.path.expanduser(str(root))))
        if not real.is_dir():
            raise ValueError(f"project root {root} is not a directory: pass an existing folder")
        self.root: Path = real
        self.extra_read_roots: tuple[Path, ...] = tuple(Path(os.path.realpath(p)) for p in extra_read_roots)

    def resolve(self, path: str, *, write: bool = False) -> Path:
        """The real path of ``path`` (relative to the root), or BoundaryError when it is outside."""
        if not isinstance(path, str) or path == "":
            raise BoundaryError("empty path: give a path relative to the project root")
        if "\x00" in path:
            raise BoundaryError("path contains a NUL byte")
        p = Path(os.path.expanduser(path))
        if not p.is_absolute():
            p = self.root / p
        # realpath follows every symlink of the existing prefix (a dangling link to its target), so
        # a new file under a symlinked folder is checked against where it would really land
        try:
            real = Path(os.path.realpath(p))
        except OSError as e:                # a link it may not read (/proc/1/root): no answer is no
            raise BoundaryError(f"{path}: cannot be checked ({e.strerror})") from None
        if any(real == s or real.is_relative_to(s) for s in _SPECIAL_ROOTS):
            raise BoundaryError(f"{path}: system paths (/proc, /sys, /dev) are not allowed")
        roots = (self.root,) if write else (self.root, *self.extra_read_roots)
        if not any(real == r or real.is_relative_to(r) for r in roots):
            where = "writes stay inside" if write else "paths must be inside"
            raise BoundaryError(f"{path}: outside the project ({where} {self.root})")
        if write and real.relative_to(self.root).parts[:1] == (".git",):
            # .git/config and hooks run code on the next git command: change them through git itself
            raise BoundaryError(f"{path}: writes inside .git are not allowed; use git commands through shell")
        try:
            st = os.stat(real)
        except FileNotFoundError:
            return real
        except OSError as e:
            raise BoundaryError(f"{path}: cannot be checked ({e.strerror})") from None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise BoundaryError(f"{path}: not a regular file or folder (device, fifo or socket)")
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            # a hard link shares its content with another name that may be outside the project, and
            # realpath cannot tell where that is
            raise BoundaryError(f"{path}: a file with {st.st_nlink} hard links is refused (another link may be "
                                "outside the project); ask the user to copy it to a new file if it is needed")
        return real

    def contains(self, path: str | Path, *, write: bool = False) -> bool:
        """Whether ``resolve`` would accept the path (no exception)."""
        try:
            self.resolve(str(path), write=write)
        except BoundaryError:
            return False
        return True

    def relative(self, path: Path) -> str:
        """Display form: relative to the root ("." for the root), absolute when outside it."""
        real = Path(os.path.realpath(path))
        if real == self.root:
            return "."
        if real.is_relative_to(self.root):
            return real.relative_to(self.root).as_posix()
        return str(real)


# -- risk classes of shell commands --------------------------------------------------------
RISKS = ("destructive", "network", "privileged", "outside-path", "credential", "vcs-rewrite")


@dataclass(frozen=True)
class Assessment:
    kind: str                              # "read" | "write" | "shell" | "meta"
    risks: frozenset[str] = frozenset()
    summary: str = ""                      # one line for an approval prompt
    refused: str | None = None             # the call can never be allowed; the tool must not run
    target: str | None = None              # write/edit: the path relative to the root, for --allow rules


_PUNCT = frozenset(";&|()<>\n")
# words that run the next word as the command
_WRAPPERS = frozenset({"nohup", "time", "nice", "ionice", "exec", "command", "builtin", "stdbuf",
                       "timeout", "watch", "xargs", "then", "do", "else", "elif", "if", "while", "until",
                       "!", "{", "}", "env"})
_SHELLS = frozenset({"bash", "sh", "zsh", "dash", "ksh", "fish", "eval"})

_DESTRUCTIVE = frozenset({"rm", "rmdir", "dd", "shred", "truncate", "unlink", "wipefs", "fdisk", "parted",
                          "sfdisk", "mkswap", "srm"})
_NETWORK = frozenset({"curl", "wget", "ssh", "scp", "sftp", "rsync", "nc", "ncat", "netcat", "telnet", "ftp",
                      "socat", "aria2c", "http", "https", "apt", "apt-get", "yum", "dnf", "brew", "snap",
                      "ping", "dig", "nslookup", "gh"})
_INSTALLERS = frozenset({"pip", "pip3", "npm", "yarn", "pnpm", "cargo", "gem", "go", "conda", "mamba", "uv",
                         "pipx", "poetry", "bun", "composer"})
_INSTALL_VERBS = frozenset({"install", "add", "i", "get", "update", "upgrade", "sync", "download", "publish",
                            "fetch", "login", "create"})
_PRIVILEGED = frozenset({"sudo", "su", "doas", "pkexec", "chown", "chgrp", "mount", "umount", "systemctl",
                         "service", "launchctl", "reboot", "shutdown", "halt", "poweroff", "modprobe", "insmod",
                         "rmmod", "iptables", "nft", "useradd", "userdel", "usermod", "passwd", "crontab",
                         "chroot", "setcap", "nsenter", "docker", "podman", "killall", "pkill", "visudo"})
_CREDENTIAL_WORD = re.compile(
    r"(^|/)\.ssh(/|$)|id_rsa|id_ed25519|id_ecdsa|id_dsa|\.pem$|\.key$|\.p12$|\.pfx$|(^|/)\.env(\.[^/]*)?$"
    r"|(^|/)\.netrc$|(^|/)\.aws(/|$)|\.git-credentials|(^|/)\.npmrc$|(^|/)\.pypirc$|(^|/)\.docker/config\.json"
    r"|(^|/)\.kube(/|$)|(^|/)\.gnupg(/|$)|/environ$|credentials|(^|/)\.config/gh(/|$)"
    r"|\$\{?\w*(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)\w*",
    re.IGNORECASE)
_GIT_GLOBAL_WITH_ARG = frozenset({"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--exec-path"})
_GIT_NETWORK = frozenset({"push", "pull", "fetch", "clone", "ls-remote", "remote", "submodule", "send-email",
                          "request-pull", "archive"})
# filters that may follow a pattern-allowed command in a pipe (they only read their input)
_SAFE_FILTERS = frozenset({"head", "tail", "grep", "wc", "sort", "uniq", "cat", "less", "more", "cut", "tr",
                           "column", "nl", "true"})


def _tokens(command: str) -> list[str]:
    lex = shlex.shlex(command, posix=True, punctuation_chars=";&|()<>\n")
    lex.whitespace_split = True
    lex.whitespace = " \t\r"
    lex.commenters = ""            # bash comments start only at a word start; shlex would cut mid-word
    return list(lex)


def _segments(command: str) -> tuple[list[list[str]], list[str], list[str]]:
    """Split into simple commands; also return redirect targets and substituted command texts.
    Raises ValueError when the text cannot be tokenised (unbalanced quotes)."""
    tokens = _tokens(command)
    segments: list[list[str]] = [[]]
    targets: list[str] = []
    inner: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "$" and i + 1 < len(tokens) and tokens[i + 1].startswith("("):
            i += 1                 # "$(" arrives as "$" then "(": the "(" opens a segment below
            continue
        punct = bool(tok) and set(tok) <= _PUNCT
        if punct and set(tok) & set("<>") and not set(tok) & set("();\n"):
            # a redirect: its target is a path being written or read (fd duplications aside)
            if i + 1 < len(tokens) and not (set(tokens[i + 1]) <= _PUNCT):
                target = tokens[i + 1]
                if not (tok.endswith("&") and target.isdigit()) and tok not in ("<<", "<<<"):
                    targets.append(target)
                i += 2
            else:
                i += 1
            continue
        if punct:                       # ; & && | || ( ) newline, and glued forms like ");" or "<("
            segments.append([])
            i += 1
            continue
        if "$(" in tok or "`" in tok:
            inner.extend(_substitutions(tok))
        segments[-1].append(tok)
        i += 1
    return [s for s in segments if s], targets, inner


def _substitutions(word: str) -> list[str]:
    """The command texts inside $( ... ) and ` ... ` of one word (quotes already removed)."""
    found: list[str] = []
    i = 0
    while i < len(word):
        if word.startswith("$(", i):
            depth, j = 1, i + 2
            while j < len(word) and depth:
                depth += {"(": 1, ")": -1}.get(word[j], 0)
                j += 1
            found.append(word[i + 2:j - 1] if depth == 0 else word[i + 2:])
            i = j
        elif word[i] == "`":
            j = word.find("`", i + 1)
            found.append(word[i + 1:] if j < 0 else word[i + 1:j])
            i = len(word) if j < 0 else j + 1
        else:
            i += 1
    return found


def outside_path(word: str, boundary: ProjectBoundary) -> bool:
    """Whether a command argument names a path outside the project, or one the boundary refuses
    (a symlink out, a hard link, a fifo): explicit paths (``/x``, ``..``, ``~``, ``$HOME``), brace
    and ``.*`` forms that spell ``..``, the value of ``key=value``, and plain names that exist."""
    if "://" in word:
        return False                   # a URL; the network class covers it
    words = _brace_expansions(word)
    # --output=/etc/x, of=/dev/sda, and x=.. whose $x a later word expands
    words += [w.split("=", 1)[1] for w in words if "=" in w]
    return any(_outside_one(w, boundary) for w in words)


def _outside_one(word: str, boundary: ProjectBoundary) -> bool:
    if word in ("/dev/null", "/dev/stdout", "/dev/stderr", "/dev/stdin", "-"):
        return False
    if word.startswith("~") or "$HOME" in word or "${HOME" in word:
        return True
    parts = word.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            # a glob is cut at its first wild part, unless that part can match ".." (".*" does where
            # bash's globskipdots is off: bash < 5.2, or "shopt -u globskipdots")
            parts = parts[:i] + ([".."] if part.startswith(".") and fnmatch.fnmatchcase("..", part) else [])
            break
    path = "/".join(parts) or ("/" if word.startswith("/") else "")
    if path.startswith("/") or ".." in path.split("/"):
        return not boundary.contains(path.rstrip("/") or "/")
    # a plain name is looked at only when it exists: a symlink out or a hard link in the project
    return bool(path) and os.path.lexists(boundary.root / path) and not boundary.contains(path)


_BRACE_LIMIT = 64


def _brace_expansions(word: str) -> list[str]:
    """The words bash's brace expansion makes of ``word`` ("{.,.}./x" is "../x"); comma lists
    only, at most _BRACE_LIMIT words (the rest stay unexpanded)."""
    done: list[str] = []
    todo = [word]
    while todo and len(done) + len(todo) <= _BRACE_LIMIT:
        w = todo.pop()
        found = _first_brace(w)
        if found is None:
            done.append(w)
            continue
        start, end, alternatives = found
        todo.extend(w[:start] + alt + w[end + 1:] for alt in alternatives)
    return done + todo


def _first_brace(word: str) -> tuple[int, int, list[str]] | None:
    """(start, end, alternatives) of the first "{a,b}" group of ``word``, or None."""
    for start, c in enumerate(word):
        if c != "{":
            continue
        depth, cuts = 0, [start]
        for j in range(start, len(word)):
            if word[j] == "{":
                depth += 1
            elif word[j] == "}":
                depth -= 1
                if depth == 0:
                    if len(cuts) > 1:
                        cuts.append(j)
                        return start, j, [word[a + 1:b] for a, b in itertools.pairwise(cuts)]
                    break
            elif word[j] == "," and depth == 1:
                cuts.append(j)
    return None


# programs whose arguments may be a program text: the paths written in it are looked at
_INTERPRETERS = re.compile(r"(python|pypy)[\d.]*|perl|ruby|node|nodejs|deno|bun|php|lua|luajit|Rscript|julia"
                           r"|osascript")
_TEXT_PROGRAMS = re.compile(r"[gmn]?awk|g?sed")
_CODE_SPLIT = re.compile(r"[\s'\"`(),;=\[\]{}<>|&+]+")


def _program_texts(args: list[str]) -> set[int]:
    """Which of awk's or sed's arguments are program text: -e values, else the first operand."""
    found: set[int] = set()
    explicit = False
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-e", "--expression", "-f", "--file"):
            if a in ("-e", "--expression"):
                found.add(i + 1)
            explicit = True
            i += 2
        elif a in ("-v", "-F", "-l"):           # awk -v x=1, awk -F :, sed -l N
            i += 2
        elif a.startswith("-") and a != "-":
            explicit = explicit or a.startswith(("--expression=", "--file="))
            i += 1
        else:
            if not explicit:
                found.add(i)
            break
    return found


def _code_paths(code: str, rooted: bool = True) -> list[str]:
    """Path-like pieces of program text: "..", "../x", "~/x", and with ``rooted`` "/etc/x"
    (never "/" alone or "1/2")."""
    return [piece for piece in _CODE_SPLIT.split(code)
            if piece == ".." or piece.startswith("../") or re.match(r"~[\w.-]*/", piece)
            or (rooted and re.match(r"/[\w.~-]", piece))]


def _calls_itself(tokens: list[str]) -> bool:
    """Whether a shell function defined in the command calls itself (the fork bomb ":(){ :|:& };:")."""
    for i, tok in enumerate(tokens):
        if tok == "function" and i + 1 < len(tokens):
            name, j = tokens[i + 1], i + 2 + (tokens[i + 2:i + 3] == ["()"])
        elif tok == "()" and i > 0:
            name, j = tokens[i - 1], i + 1
        elif tok == "(" and i > 0 and tokens[i + 1:i + 2] == [")"]:
            name, j = tokens[i - 1], i + 2
        else:
            continue
        while tokens[j:j + 1] == ["\n"]:
            j += 1
        if tokens[j:j + 1] not in (["{"], ["("]):
            continue                    # not a shell function ("def main():" in a heredoc)
        opener, closer = tokens[j], "}" if tokens[j] == "{" else ")"
        depth = 0
        for t in tokens[j:]:
            if t == name:
                return True
            depth += t.count(opener) - t.count(closer)
            if depth <= 0:
                break
    return False


def classify_shell(command: str, boundary: ProjectBoundary) -> frozenset[str]:
    """Risk classes of a shell command (see RISKS); empty for ordinary commands."""
    return frozenset(_classify(command, boundary, depth=0))


def _classify(command: str, boundary: ProjectBoundary, depth: int) -> set[str]:
    if depth > 4:
        return {"destructive"}          # nested shells this deep are not worth guessing about
    try:
        segments, targets, inner = _segments(command)
    except ValueError:
        return {"destructive"}          # unbalanced quotes: cannot tell what runs
    risks: set[str] = set()
    for target in targets:
        if _CREDENTIAL_WORD.search(target):
            risks.add("credential")
        if outside_path(target, boundary):
            risks |= {"outside-path", "destructive"}
    for text in inner:
        risks |= _classify(text, boundary, depth + 1)
    for words in segments:
        risks |= _classify_simple(words, boundary, depth)
    if _calls_itself(_tokens(command)):
        # it forks until the machine stops answering: a system-wide act, like kill 1
        risks |= {"destructive", "privileged"}
    # reads of redirect sources count as well ("< ~/.ssh/id_rsa" is caught above)
    return risks


def _command_start(words: list[str]) -> tuple[list[str], set[str]]:
    """Skip variable assignments and wrappers (sudo, env, timeout, xargs ...) to the real command."""
    risks: set[str] = set()
    i = 0
    while i < len(words):
        w = words[i]
        base = os.path.basename(w)
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w):
            i += 1
        elif base in ("sudo", "doas", "su", "pkexec"):
            risks.add("privileged")
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 1 + (words[i] in ("-u", "-g", "-C", "-c"))
        elif base == "env":
            rest = words[i + 1:]
            if not any(not a.startswith("-") and "=" not in a for a in rest):
                return words[i:], risks             # plain "env" prints the environment
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 1 + (words[i] in ("-u", "-C", "-S"))
        elif base in ("timeout",):
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 1 + (words[i] in ("-s", "-k", "--signal", "--kill-after"))
            i += 1                                  # the duration
        elif base == "xargs":
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 1 + (words[i] in ("-n", "-I", "-P", "-L", "-d", "-s", "-E", "-a", "-i"))
        elif base in ("nice", "ionice", "stdbuf", "watch"):
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 1 + (words[i] in ("-n", "-c", "-p", "-i", "-o", "-e", "-d"))
        elif base in _WRAPPERS:
            i += 1
        else:
            break
    return words[i:], risks


def _classify_simple(words: list[str], boundary: ProjectBoundary, depth: int) -> set[str]:
    start, risks = _command_start(words)
    cmd = os.path.basename(start[0]) if start else ""
    programs = _program_texts(start[1:]) if _TEXT_PROGRAMS.fullmatch(cmd) else set()
    # the arguments, and the assignments and wrappers before the command ("x=..; cat $x/secret");
    # awk's and sed's program is text, whose "/regex/" is not a path
    named = words[:len(words) - len(start)] + [a for i, a in enumerate(start[1:]) if i not in programs]
    if any(outside_path(w, boundary) for w in named):
        risks.add("outside-path")
    words = start
    if not words:
        return risks
    args = words[1:]
    for arg in args:
        if _CREDENTIAL_WORD.search(arg):
            risks.add("credential")
    if _INTERPRETERS.fullmatch(cmd) or _TEXT_PROGRAMS.fullmatch(cmd):
        # inline programs (python -c, perl -e, awk '...'): literal paths in them count; a path the
        # program computes cannot be seen, which is why the shell is not a sandbox
        rooted = not _TEXT_PROGRAMS.fullmatch(cmd)          # awk's and sed's /regex/ are not paths
        for piece in (p for arg in args for p in _code_paths(arg, rooted)):
            if outside_path(piece, boundary):
                risks.add("outside-path")
            if _CREDENTIAL_WORD.search(piece):
                risks.add("credential")
    if cmd in ("cd", "pushd") and not [a for a in args if not a.startswith("-")]:
        risks.add("outside-path")                   # a bare cd goes to $HOME
    if _CREDENTIAL_WORD.search(words[0]):
        risks.add("credential")

    if cmd in _DESTRUCTIVE or cmd.startswith("mkfs"):
        risks.add("destructive")
    if cmd in _NETWORK:
        risks.add("network")
    if cmd in _PRIVILEGED:
        risks.add("privileged")
    if cmd in _SHELLS:
        script = _shell_script(cmd, args)
        if script is not None:
            risks |= _classify(script, boundary, depth + 1)
    if cmd in _INSTALLERS and any(a in _INSTALL_VERBS for a in args[:3]):
        risks.add("network")
    if cmd.startswith("python") and "-m" in args[:-1]:
        module = args[args.index("-m") + 1]
        if module in ("pip", "pip3", "uv") and any(a in _INSTALL_VERBS for a in args):
            risks.add("network")
    if cmd == "find":
        if "-delete" in args:
            risks.add("destructive")
        for flag in ("-exec", "-execdir", "-ok", "-okdir"):
            if flag in args:
                sub = args[args.index(flag) + 1:]
                sub = [a for a in sub if a not in ("{}", "+", ";")]
                risks |= _classify_simple(sub, boundary, depth + 1)
    if cmd in ("chmod",) and any(a.startswith("-") and "R" in a for a in args):
        risks.add("destructive")
    if cmd == "kill" and any(a in ("1", "-1") for a in args):
        risks.add("privileged")
    if cmd == "printenv" or (cmd == "set" and not args) or \
            (cmd in ("export", "declare", "typeset") and all(a in ("-p", "-x", "-px", "-xp") for a in args)):
        risks.add("credential")                     # these print the environment
    if cmd == "env" and not [a for a in args if not a.startswith("-")]:
        risks.add("credential")
    if cmd in ("cat", "less", "more", "head", "tail", "strings", "xxd") and any("/proc/" in a for a in args):
        risks.add("credential")
    if cmd == "git":
        risks |= _classify_git(args)
    return risks


def _shell_script(cmd: str, args: list[str]) -> str | None:
    if cmd == "eval":
        return " ".join(args)
    for i, a in enumerate(args):
        if a == "-c" or (a.startswith("-") and not a.startswith("--") and "c" in a):
            return args[i + 1] if i + 1 < len(args) else ""
    return None                                     # "bash script.sh": the script is the user's


def _classify_git(args: list[str]) -> set[str]:
    risks: set[str] = set()
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 1 + (args[i] in _GIT_GLOBAL_WITH_ARG)   # -C dir, -c key=value
    if i >= len(args):
        return risks
    sub, rest = args[i], args[i + 1:]
    if sub in _GIT_NETWORK:
        risks.add("network")
    if sub == "credential" or (sub == "config" and any("credential" in a for a in rest)):
        risks.add("credential")
    if sub == "push" and any(a in ("-f", "--force", "--force-with-lease", "--mirror", "--delete", "-d")
                             or a.startswith("--force") or (a.startswith("+") and len(a) > 1) for a in rest):
        risks.add("vcs-rewrite")
    if sub == "reset" and any(a in ("--hard", "--merge", "--keep") for a in rest):
        risks.add("vcs-rewrite")
    if sub in ("rebase", "filter-branch", "filter-repo", "replace"):
        risks.add("vcs-rewrite")
    if sub == "commit" and "--amend" in rest:
        risks.add("vcs-rewrite")
    if sub == "checkout" and any(a in ("--", ".", "-f", "--force", "-B") for a in rest):
        risks.add("vcs-rewrite")
    if sub == "restore" or (sub == "switch" and any(a in ("-f", "--force", "--discard-changes", "-C") for a in rest)):
        risks.add("vcs-rewrite")
    if sub == "clean":
        risks |= {"destructive", "vcs-rewrite"}
    if sub == "branch" and any(a in ("-D", "-d", "--delete", "-f", "--force", "-M", "-m") for a in rest):
        risks.add("vcs-rewrite")
    if sub == "stash" and rest[:1] and rest[0] in ("drop", "clear"):
        risks.add("vcs-rewrite")
    if sub in ("reflog", "gc", "prune", "update-ref") and any(a in ("expire", "delete", "-d", "--prune=now")
                                                              or a.startswith("--prune") for a in rest):
        risks.add("vcs-rewrite")
    return risks


# -- decisions -------------------------------------------------------------------------------
class Mode(str, Enum):
    READ_ONLY = "read-only"
    ASK = "ask"
    AUTO = "auto"


_RULE_TOOLS = ("shell", "write", "edit")
_RULE_FORMS = ("'shell', 'shell:PATTERN' (e.g. 'shell:pytest*'), 'write', 'write:GLOB' (e.g. 'write:src/**'), "
               "'edit', 'edit:GLOB'")
# a rule never lets these through unasked: the user must see them every time (outside-path: no
# rule opens the project boundary)
_ALWAYS_ASK = frozenset({"privileged", "credential", "outside-path"})


@dataclass(frozen=True)
class AllowRule:
    """One --allow rule: a tool, optionally narrowed by a pattern on its command or path."""
    tool: str
    pattern: str | None = None

    @classmethod
    def parse(cls, text: str) -> "AllowRule":
        tool, sep, pattern = text.strip().partition(":")
        tool = tool.strip()
        if tool not in _RULE_TOOLS or (sep and not pattern.strip()):
            raise ValueError(f"--allow {text!r} is not a rule; accepted forms: {_RULE_FORMS}")
        return cls(tool, pattern.strip() if sep else None)

    def matches(self, tool: str, args: dict) -> bool:
        if tool != self.tool:
            return False
        if self.pattern is None:
            return True
        if tool == "shell":
            return _shell_matches(self.pattern, str(args.get("command", "")))
        path = os.path.normpath(str(args.get("path", "")))
        return fnmatch.fnmatchcase(Path(path).as_posix(), self.pattern)

    def __str__(self) -> str:
        return self.tool if self.pattern is None else f"{self.tool}:{self.pattern}"


def _shell_matches(pattern: str, command: str) -> bool:
    """Every simple command must match the pattern (or be a read-only filter in a pipe), so
    'pytest*' does not let 'pytest; rm -rf x' through; substitutions and redirects outside
    the project never match."""
    try:
        segments, targets, inner = _segments(command)
    except ValueError:
        return False
    if inner or "`" in command or "$(" in command or not segments:
        return False
    if any(t.startswith(("/", "~")) and t != "/dev/null" or ".." in t.split("/") for t in targets):
        return False
    for i, words in enumerate(segments):
        text = shlex.join(words)
        if fnmatch.fnmatchcase(text, pattern) or fnmatch.fnmatchcase(" ".join(words), pattern):
            continue
        if i > 0 and os.path.basename(words[0]) in _SAFE_FILTERS:
            continue
        return False
    return True


@dataclass(frozen=True)
class Decision:
    action: str                   # "allow" | "ask" | "deny"
    reason: str


def decide(mode: Mode, tool: str, args: dict, assessment: Assessment, rules: Sequence[AllowRule] = (),
           interactive: bool = True) -> Decision:
    """Whether a call runs ("allow"), needs the user ("ask") or is refused ("deny")."""
    if assessment.refused:
        return Decision("deny", assessment.refused)
    if assessment.kind in ("read", "meta"):
        return Decision("allow", f"{assessment.kind} tools are always allowed")
    mode = Mode(mode)
    if mode is Mode.READ_ONLY:
        return Decision("deny", f"read-only mode: {tool} is not allowed")
    if assessment.target is not None:
        args = {**args, "path": assessment.target}
    risks = sorted(assessment.risks)
    pinned = sorted(assessment.risks & _ALWAYS_ASK)
    rule = next((r for r in rules if r.matches(tool, args)), None)
    if pinned:
        decision = Decision("ask", f"risky: {', '.join(risks)} "
                                   f"(always asked, --allow cannot cover {', '.join(pinned)})")
    elif rule is not None:
        return Decision("allow", f"matches --allow {rule}")
    elif mode is Mode.AUTO and not risks:
        return Decision("allow", "auto mode: no risk found")
    elif risks:
        decision = Decision("ask", f"risky: {', '.join(risks)}")
    else:
        decision = Decision("ask", f"ask mode: {tool} needs approval")
    if interactive:
        return decision
    if pinned:
        return Decision("deny", f"{decision.reason}; not interactive, so denied")
    rule_text = _suggest_rule(tool, args)
    return Decision("deny", f"{decision.reason}; not interactive: rerun with --allow '{rule_text}' to allow it")


def _suggest_rule(tool: str, args: dict) -> str:
    if tool == "shell":
        try:
            words = _tokens(str(args.get("command", "")))
        except ValueError:
            return "shell"
        return f"shell:{words[0]}*" if words else "shell"
    if tool in ("write", "edit") and args.get("path"):
        return f"{tool}:{Path(os.path.normpath(str(args['path']))).as_posix()}"
    return tool


# -- the shell's environment --------------------------------------------------------------------
_SAFE_ENV = frozenset({"PATH", "HOME", "LANG", "LANGUAGE", "TERM", "USER", "LOGNAME", "SHELL", "TMPDIR", "TZ",
                       "VIRTUAL_ENV", "COLUMNS", "LINES", "NO_COLOR", "COLORTERM", "CONDA_PREFIX",
                       "CONDA_DEFAULT_ENV", "JAVA_HOME", "GOPATH", "GOROOT", "CARGO_HOME", "RUSTUP_HOME",
                       "NVM_DIR", "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "XDG_CACHE_HOME",
                       "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR", "EDITOR", "PYTHONIOENCODING"})
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION", re.IGNORECASE)
# a non-interactive shell: nothing may wait for a pager or a password prompt
_FIXED_ENV = {"PAGER": "cat", "GIT_PAGER": "cat", "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"}


def scrubbed_env(parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for the agent's commands: only known-safe variables of ``parent``
    (default os.environ) pass, so API keys and tokens never reach the model's commands."""
    parent = os.environ if parent is None else parent
    env = {k: v for k, v in parent.items()
           if (k in _SAFE_ENV or k.startswith("LC_")) and not _SECRET_NAME.search(k)}
    env.setdefault("PATH", os.defpath)
    env.update(_FIXED_ENV)
    return env
