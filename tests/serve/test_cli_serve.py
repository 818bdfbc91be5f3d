import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from lodestar.cli import main


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "example.org"])
def test_non_loopback_without_key_is_refused_before_loading(host, capsys, monkeypatch):
    monkeypatch.delenv("LODESTAR_API_KEY", raising=False)
    t0 = time.perf_counter()
    assert main(["serve", "--host", host]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--api-key" in err and host in err
    assert time.perf_counter() - t0 < 1.0          # refused before any model is loaded


def test_busy_port_is_a_one_line_error(capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert main(["serve", "--port", str(s.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen" in err


def test_serve_prints_url_and_answers(smollm_path):
    proc = subprocess.Popen([sys.executable, "-m", "lodestar.cli", "serve", "--port", "0", "--model", str(smollm_path),
                             "--served-model-name", "local", "--served-model-name", "gpt-4o-mini"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert url, (line, proc.stderr.read() if proc.poll() is not None else "")
        base = url.group(1)
        assert httpx.get(base + "/health").json()["status"] == "ok"
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == ["local", "gpt-4o-mini"]
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "gpt-4o-mini", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
