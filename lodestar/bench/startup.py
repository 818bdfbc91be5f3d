"""``lodestar bench startup``: how soon a user sees the first token, measured from outside.

- ``generate``: from starting ``lodestar generate -p PROMPT`` to the first byte it writes to
  stdout (the first token's text), a fresh process each run.
- ``chat``: in a running ``lodestar chat``, from sending a short message to the first byte of
  the reply (the first turn of a fresh process, then a second turn).
- ``import torch``: a bare ``python -c "import torch"``, the floor under every Python engine.
- ``llama.cpp``: when llama-cpp-python is installed, a process that loads the same GGUF with
  it and streams the same prompt, to its first token.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from lodestar.bench.common import Stat, git_commit

PROMPT = "def fibonacci(n):"
MESSAGE = "Hello! Who are you?"

_PEER = r"""
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]),
            verbose=False)
for part in llm(sys.argv[3], max_tokens=8, temperature=0.0, stream=True):
    sys.stdout.write(part["choices"][0]["text"] or " ")
    sys.stdout.flush()
"""


def _first_byte(cmd: list[str], env: dict, timeout: float) -> float:
    """Seconds from starting ``cmd`` to the first byte on its stdout; the process is then ended."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env,
                         bufsize=0)
    try:
        if not p.stdout.read(1):
            raise RuntimeError(f"{' '.join(cmd[:3])} ... wrote nothing (exit {p.wait(timeout)})")
        return time.perf_counter() - t
    finally:
        p.kill()
        p.wait()


def _read_until(stream, marker: bytes, deadline: float) -> None:
    seen = b""
    while not seen.endswith(marker):
        b = stream.read(1)
        if not b or time.perf_counter() > deadline:
            raise RuntimeError(f"lodestar chat ended or stalled before printing {marker!r}")
        seen = seen[-64:] + b


def _chat_turns(cmd: list[str], env: dict, timeout: float) -> tuple[float, float]:
    """First-token seconds of the first and second message of one ``lodestar chat`` process."""
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                         bufsize=0)
    deadline = time.perf_counter() + timeout
    try:
        times = []
        for _ in range(2):
            _read_until(p.stdout, b">>> ", deadline)
            t = time.perf_counter()
            p.stdin.write(MESSAGE.encode() + b"\n")
            p.stdin.flush()
            if not p.stdout.read(1):
                raise RuntimeError("lodestar chat ended before answering")
            times.append(time.perf_counter() - t)
        return times[0], times[1]
    finally:
        p.kill()
        p.wait()


def main(a) -> int:
    from lodestar.engine.loader import open_checkpoint
    path, source = open_checkpoint(a.model)
    getattr(source, "close", lambda: None)()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    lodestar = [sys.executable, "-m", "lodestar.cli"]
    model = ["--model", str(path), "--threads", str(a.threads)]
    stats = {"import_torch_s": Stat(), "generate_first_token_s": Stat(), "chat_first_token_s": Stat(),
             "chat_second_turn_s": Stat()}
    peer = None
    try:
        import llama_cpp  # noqa: F401
        peer = Stat()
    except ImportError:
        pass
    for _ in range(a.runs):
        stats["import_torch_s"].add(_first_byte([sys.executable, "-c", "import torch; print(1)"], env, a.timeout))
        stats["generate_first_token_s"].add(_first_byte(
            lodestar + ["generate", "-p", PROMPT, "--raw", "-n", "8", *model], env, a.timeout))
        first, second = _chat_turns(lodestar + ["chat", *model, "-n", "8"], env, a.timeout)
        stats["chat_first_token_s"].add(first)
        stats["chat_second_turn_s"].add(second)
        if peer is not None:
            peer.add(_first_byte([sys.executable, "-c", _PEER, str(path), str(a.threads), PROMPT], env, a.timeout))
    if peer is not None:
        stats["llama_cpp_generate_first_token_s"] = peer
    print(f"{path.name}, {a.threads} threads, {a.runs} runs; seconds, median [min–max]")
    for name, s in stats.items():
        print(f"  {name:34s} {s.fmt(3)}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"bench": "startup", "commit": git_commit(), "model": path.name,
                                      "threads": a.threads, **{k: v.as_dict() for k, v in stats.items()}}, indent=2))
    return 0
