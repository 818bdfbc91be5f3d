"""``lodestar bench report``: one offline HTML page from a folder of benchmark result files."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from lodestar import cli
from lodestar.serve.web.report_html import ReportError, build_report
from lodestar.serve import ServeConfig, build_app

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def stat(median: float, lo: float, hi: float) -> dict:
    return {"min": lo, "median": median, "max": hi, "runs": [lo, median, hi]}


DECODE = {"bench": "decode", "model": "tiny.gguf", "commit": "abc1234", "device": {"cpu": "Test CPU", "cores": 2},
          "results": {"lodestar": {"load_s": stat(0.5, 0.4, 0.6), "decode_256_tok_s": stat(66.15, 64.99, 66.76)},
                      "llama.cpp": {"load_s": stat(0.09, 0.08, 0.1), "decode_256_tok_s": stat(102.1, 101.2, 102.2)}}}
SERVE_LOAD = {"bench": "serve-load", "model": "tiny.gguf",
              "results": {str(n): {"tok_s": stat(60.0 * n, 59.0 * n, 61.0 * n),
                                   "ttft_p50_ms": stat(100.0 * n, 99.0 * n, 101.0 * n)} for n in (1, 4, 8, 16)}}
SPEC_FAILED = {"bench": "spec", "model": "tiny.gguf", "failures": ["edit: greedy tokens differ on vs off"],
               "parts": {"edit": {"decode_tok_s": {"off": stat(19.2, 18.9, 21.0), "on": stat(23.1, 21.1, 25.4)},
                                  "ratio": stat(1.22, 1.01, 1.32), "identical": False,
                                  "speculation": {"acceptance_rate": 0.77}},
                         "chat": {"error": "RuntimeError: CUDA error: out of memory"}}}
UNKNOWN = {"about": "a shape no builder knows", "custom": {"metric_ms": 12.5, "label": "plain"},
           "runner": ["setup: exit 0 after 3s", "measure: exit 137 after 600s"]}


def write(folder: Path, name: str, doc) -> None:
    (folder / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))


@pytest.fixture()
def results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    (folder / "nested").mkdir(parents=True)
    write(folder, "cpu-decode.json", DECODE)
    write(folder, "cpu-serve-load.json", SERVE_LOAD)
    write(folder / "nested", "spec.json", SPEC_FAILED)
    write(folder, "odd.json", UNKNOWN)
    write(folder, "broken.json", '{"bench": "decode", "results": ')
    write(folder, "notes.txt", "not a result file")
    return folder


def section(page: str, name: str) -> str:
    """The HTML of the section that reports file ``name``."""
    start = page.index(f"{name} <span")
    end = page.find("<section", start)
    return page[start:end if end != -1 else len(page)]


def test_every_result_file_gets_a_section_with_its_headline_numbers(results):
    page = build_report(results)
    for name in ("cpu-decode.json", "cpu-serve-load.json", "nested/spec.json", "odd.json", "broken.json"):
        assert f"{name} <span" in page
    assert "notes.txt" not in page

    decode = section(page, "cpu-decode.json")
    assert "66.15 [64.99–66.76]" in decode and "102.1 [101.2–102.2]" in decode     # median [min–max]
    assert "llama.cpp" in decode and "Test CPU" in decode and "abc1234" in decode
    assert "<svg" in decode and "<rect" in decode                                  # bars: lodestar vs llama.cpp

    serve = section(page, "cpu-serve-load.json")
    assert "<polyline" in serve                                                    # a series over stream counts
    assert all(f"<th>{n}</th>" in serve for n in (1, 4, 8, 16))
    assert "960.0 [944.0–976.0]" in serve                                          # 16 streams' tok/s

    odd = section(page, "odd.json")
    assert "custom.metric_ms" in odd and "12.50" in odd and "a shape no builder knows" in odd


def test_failures_and_errors_are_shown_in_red(results):
    page = build_report(results)
    spec = section(page, "nested/spec.json")
    box = spec[spec.index('class="failures"'):]
    box = box[:box.index("</div>")]
    assert "greedy tokens differ on vs off" in box
    assert "CUDA error: out of memory" in box
    assert "parts.edit.identical is false" in box
    assert "3 failures" in box

    odd = section(page, "odd.json")
    assert "measure: exit 137 after 600s" in odd[odd.index('class="failures"'):]
    assert "setup: exit 0" not in odd[odd.index('class="failures"'):odd.index("</div>")]

    broken = section(page, "broken.json")
    assert 'class="failures"' in broken and "not a readable JSON file" in broken

    summary = page[:page.index("<section")]
    assert re.search(r'nested/spec\.json</a>.*?<td class="bad">3 failures</td>', summary)
    assert re.search(r'broken\.json</a>.*?<td class="bad">unreadable</td>', summary)
    assert re.search(r'cpu-decode\.json</a>.*?<td class="ok">ok</td>', summary)
    assert "3 with failures" in summary


def test_every_string_from_a_result_is_escaped(tmp_path):
    hostile = '<script>alert("x")</script>'
    attr = '" onmouseover="alert(1)'
    doc = {"bench": "decode", "model": hostile, "commit": attr,
           "results": {hostile: {"decode_256_tok_s": stat(10.0, 9.0, 11.0)},
                       attr: {"decode_256_tok_s": stat(20.0, 19.0, 21.0), "note": f"{hostile} {'x' * 500}"}},
           "failures": [hostile]}
    write(tmp_path, "bad<name>.json", doc)
    write(tmp_path, "other.json", {"<img src=x onerror=alert(1)>": {"k'ey": attr}, "runner": [f"{hostile}: exit 1"]})
    page = build_report(tmp_path)
    assert "<script" not in page.lower()
    assert "<img" not in page and "<name>" not in page
    assert 'onmouseover="' not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page       # shown, as text
    assert "bad&lt;name&gt;.json" in page


def test_the_page_is_self_contained(results, tmp_path):
    write(results, "links.json", {"bench": "http", "endpoint": "http://example.com/v1/chat/completions",
                                  "results": {"1": {"ratio": stat(0.9, 0.8, 1.0)}},
                                  "script": "https://cdn.example.com/x.js"})
    page = build_report(results)
    links = re.findall(r'\b(?:src|href)\s*=\s*["\']?([^"\'\s>]*)', page, flags=re.IGNORECASE)
    assert links and all(link.startswith("#") for link in links)                # only in-page anchors
    for fetcher in ("<link", "<script", "<iframe", "<img", "@import", "url("):
        assert fetcher not in page.lower()
    assert "http://example.com/v1/chat/completions" in page                       # data, shown as text


def test_the_checked_in_results_all_read_as_their_shapes():
    if not RESULTS.is_dir():
        pytest.skip("no bench/results folder in this installation")
    page = build_report(RESULTS)
    for path in RESULTS.rglob("*.json"):
        assert f"{path.relative_to(RESULTS).as_posix()} <span" in page
    assert "could not read this file as" not in page
    assert page.count("<svg") >= len(list(RESULTS.glob("*.json"))) // 2


def test_cli_writes_the_report(results, tmp_path, capsys):
    out = tmp_path / "out" / "report.html"
    assert cli.main(["bench", "report", str(results), "-o", str(out)]) == 0
    assert "cpu-serve-load.json" in out.read_text(encoding="utf-8")
    assert str(out) in capsys.readouterr().out


def test_cli_explains_a_missing_or_empty_folder(tmp_path, capsys):
    assert cli.main(["bench", "report", str(tmp_path / "nowhere"), "-o", str(tmp_path / "r.html")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="--json FILE"):
        build_report(tmp_path / "empty")
    assert not (tmp_path / "r.html").exists()


class _Tokenizer:
    """What the server reads from a tokenizer at start (it looks up markup tokens)."""

    vocab_size = 8

    def piece_to_id(self, piece: str):
        return None


class _IdleEngine:
    tokenizer = _Tokenizer()
    max_model_len = 256

    def stats(self) -> dict:
        return {"waiting": 0, "running": 0, "kv_blocks_used": 0, "kv_blocks_total": 16}


def test_server_serves_the_report_of_its_results_folder(results, tmp_path):
    app = build_app(_IdleEngine(), ServeConfig(model_names=("m",)))
    app.state.bench_results = results
    client = TestClient(app)
    r = client.get("/report")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "cpu-decode.json" in r.text and "66.15 [64.99–66.76]" in r.text

    app.state.bench_results = tmp_path / "nowhere"
    r = client.get("/report")
    assert r.status_code == 404
    assert "--bench-results DIR" in r.json()["error"]["message"]
