"""The benchmark report: one self-contained HTML page from every result JSON under a folder
(``lodestar bench report DIR`` writes it; ``GET /report`` serves it).

Offline by construction: inline CSS and SVG charts, no script, no external URL, and every
string taken from a result file is HTML-escaped. The result shapes of the benchmarks
(decode, serve-load, http, cache, agent, spec, spec-curve, structured, GPU A/B and GPU
stages, grammar engines) get headline tables and charts; every file also gets a flattened
table of all its values, so nothing under DIR is left out. Failures and errors a result
records (``failures``, ``errors``, ``error``, identity checks that came out false, runner
steps that exited non-zero) are listed in red at the top of its section and counted in the
summary. Standard library only.
"""
from __future__ import annotations

import datetime
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_FLAT_ROWS = 400        # values listed per file; the rest are counted, not shown
MAX_COLUMNS = 12           # columns of a headline table
MAX_CHARTS = 12            # charts per file
MAX_CATEGORIES = 40        # bars or x positions per chart
MAX_SERIES = 8
CELL_CHARS = 120           # a string in a table cell is cut here
FULL_TEXT_CHARS = 20_000   # a long string's full text (behind <details>) is cut here
MAX_FAILURES_SHOWN = 50
MAGNITUDE_SPLIT = 10.0     # series whose peaks differ more than this get separate charts

STAT_KEYS = ("min", "median", "max")
STAT_EXTRAS = frozenset({"runs", "round_medians"})
# Keys whose non-empty value means something went wrong.
ERROR_KEYS = frozenset({"error", "errors", "failures", "failed", "exception", "traceback", "wrong_length",
                        "differences"})
# Checks that must come out true (same greedy tokens, same text ...).
MUST_BE_TRUE = frozenset({"identical", "greedy_identical", "greedy_repeatable", "same_text", "same_tokens",
                          "identical_text", "same", "ok", "passed"})
_EXIT = re.compile(r"\bexit (\d+)")
# (suffix of a key, unit); the first match wins, so "tok_s" comes before "_s".
_UNITS = (("tok_s", "tok/s"), ("_ms", "ms"), ("_us", "µs"), ("_pct", "%"), ("ratio", "×"), ("_gb", "GB"),
          ("seconds", "s"), ("_s", "s"))
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1", "#edc948", "#9c755f")


class ReportError(Exception):
    """A report that cannot be built (the folder is missing or holds no result file)."""


# -- what a section holds --------------------------------------------------------------------------
@dataclass
class Table:
    title: str
    columns: list[str]             # the first names the row labels
    rows: list[list[Any]]


@dataclass
class Chart:
    title: str
    unit: str
    categories: list[str]          # bar groups, or the x positions of a line chart
    series: dict[str, list[float | None]]
    kind: str = "bar"              # bar | line


@dataclass
class Section:
    path: str                      # relative to the report's folder
    kind: str
    meta: list[tuple[str, str]] = field(default_factory=list)
    about: str = ""
    tables: list[Table] = field(default_factory=list)
    charts: list[Chart] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    flat: list[tuple[str, Any]] = field(default_factory=list)
    flat_left_off: int = 0
    notes: list[str] = field(default_factory=list)
    error: str | None = None       # the file could not be read


# -- value helpers -----------------------------------------------------------------------------------
def is_stat(v: Any) -> bool:
    """A ``{min, median, max, ...}`` record of repeated measurements."""
    return isinstance(v, dict) and all(_is_number(v.get(k)) for k in STAT_KEYS)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_like(key: Any) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and key.lstrip("-").isdigit())


def _magnitude(v: Any) -> float | None:
    """The number a chart plots for a cell: a stat's median, a plain number, else None."""
    x = v["median"] if is_stat(v) else v
    return float(x) if _is_number(x) and math.isfinite(x) else None


def unit_of(column: str) -> str | None:
    for part in reversed(column.split(".")):
        for suffix, unit in _UNITS:
            if part.endswith(suffix):
                return unit
    return None


def fmt_number(x: float) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if not math.isfinite(x):
        return str(x)
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return "0" if x == 0 else f"{x:.3g}"


def _esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def _cut_middle(s: str, n: int) -> str:
    """Keeps both ends: chart labels are "cell · metric", and the metric is at the end."""
    if len(s) <= n:
        return s
    head = (n - 1) // 2
    return s[:head] + "…" + s[len(s) - (n - 1 - head):]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _nice_step(span: float) -> float:
    """A round grid step (1, 2, 2.5 or 5 times a power of ten) giving about four lines over ``span``."""
    raw = span / 4 if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def _short(v: Any, n: int = 200) -> str:
    return _cut(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str), n)


# -- reading -----------------------------------------------------------------------------------------
def result_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.json") if p.is_file())


def load_sections(root: Path) -> list[Section]:
    """One section per ``*.json`` under ``root`` (sorted by path); an unreadable file is a section with its error."""
    sections = []
    for path in result_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            sections.append(Section(rel, "unreadable", error=f"not a readable JSON file: {e}"))
            continue
        sections.append(describe(rel, doc))
    return sections


def kind_of(doc: Any) -> str:
    if not isinstance(doc, dict):
        return "other"
    bench = doc.get("bench")
    if isinstance(bench, str) and bench in _BUILDERS:
        return bench
    if {"trees", "cells", "summary"} <= doc.keys():
        return "gpu-ab"
    if isinstance(doc.get("stages"), dict):
        return "gpu-stages"
    if "tokens_walked" in doc:
        return "grammar-engines"
    return bench if isinstance(bench, str) else "other"


def describe(path: str, doc: Any) -> Section:
    """The section of one parsed result file."""
    kind = kind_of(doc)
    sec = Section(path, kind, meta=_meta(doc), failures=find_failures(doc))
    if isinstance(doc, dict):
        about = doc.get("about", doc.get("_about", doc.get("description")))
        sec.about = about if isinstance(about, str) else ""
    builder = _BUILDERS.get(kind)
    try:
        if builder is not None:
            builder(doc, sec)
        else:
            _series_tables(doc, sec)
        _stage_charts(doc, sec)
    except Exception as e:  # noqa: BLE001 - a result of an unexpected shape still gets its flattened values
        sec.tables, sec.charts = [], []
        sec.notes.append(f"could not read this file as a {kind} result ({type(e).__name__}: {e}); "
                         "all its values are listed below")
    del sec.charts[MAX_CHARTS:]
    flat = flatten(doc)
    sec.flat, sec.flat_left_off = flat[:MAX_FLAT_ROWS], max(0, len(flat) - MAX_FLAT_ROWS)
    return sec


def _meta(doc: Any) -> list[tuple[str, str]]:
    if not isinstance(doc, dict):
        return []
    out = []
    model = doc.get("model")
    if isinstance(model, dict):
        model = model.get("name")
    if isinstance(model, str):
        out.append(("model", model))
    for key in ("dtype", "lodestar_device", "commit"):
        if isinstance(doc.get(key), (str, int, float)):
            out.append((key.replace("lodestar_", ""), str(doc[key])))
    device = doc.get("device")
    if isinstance(device, dict):
        name = device.get("gpu") or device.get("name") or device.get("cpu")
        if name:
            out.append(("machine", f"{name}" + (f", {device['cores']} cores" if device.get("cores") else "")))
    if _is_number(doc.get("runs")):
        out.append(("runs", str(doc["runs"])))
    return out


def find_failures(doc: Any) -> list[str]:
    """Every error, failure and false identity check a result records, as ``path: what``."""
    out: list[str] = []
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                at = f"{where}.{k}" if where else str(k)
                if k in ERROR_KEYS and x not in (None, False, 0, "", [], {}) \
                        and not (isinstance(x, str) and x.strip() == "0"):     # pytest's summary: errors="0"
                    if isinstance(x, list):          # one line per recorded failure
                        out += [f"{at}[{i}]: {_short(item)}" for i, item in enumerate(x)]
                    else:
                        out.append(f"{at}: {_short(x)}")
                    continue
                if k in MUST_BE_TRUE and x is False:
                    out.append(f"{at} is false")
                elif k == "runner" and isinstance(x, list):
                    out += [f"{at}: {line}" for line in x if isinstance(line, str)
                            and any(int(n) != 0 for n in _EXIT.findall(line))]
                stack.append((at, x))
        elif isinstance(v, list):
            stack += [(f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v)))]
    return out


def flatten(doc: Any) -> list[tuple[str, Any]]:
    """(path, value) for every leaf: a scalar, a stat record, or a list of scalars."""
    out: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, v = stack.pop()
        if is_stat(v) or not isinstance(v, (dict, list)) or not v \
                or (isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v)):
            out.append((where or "(value)", v))
        elif isinstance(v, dict):
            stack += [(f"{where}.{k}" if where else str(k), x) for k, x in reversed(list(v.items()))]
        else:
            stack += [(f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v)))]
    return out


# -- headline tables and charts --------------------------------------------------------------------
def row_cells(value: Any, name: str = "value") -> dict[str, Any]:
    """One table row from a nested value: column path -> leaf (a stat record stays one cell)."""
    cells: dict[str, Any] = {}

    def walk(v: Any, path: str) -> None:
        if is_stat(v):
            cells[path or name] = v
            for k, x in v.items():      # counts recorded next to a stat (agent: prompt_tokens)
                if k not in STAT_KEYS and k not in STAT_EXTRAS:
                    walk(x, f"{path}.{k}" if path else str(k))
        elif isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else str(k))
        else:
            cells[path or name] = v

    walk(value, "")
    return cells


def keyed(sec: Section, title: str, rows: dict, label: str, *, name: str = "value",
          columns: list[str] | None = None, series_by_rows: bool = False) -> None:
    """A headline table with one row per key of ``rows``, and charts of its numeric columns."""
    if not rows:
        return
    items = list(rows.items())
    numeric_x = all(_int_like(k) for k, _ in items)
    if numeric_x:
        items.sort(key=lambda kv: int(kv[0]))
    cells = {str(k): row_cells(v, name) for k, v in items}
    if columns is None:
        columns = list(dict.fromkeys(c for row in cells.values() for c in row))
        if len(columns) > MAX_COLUMNS:
            sec.notes.append(f"{title}: {len(columns) - MAX_COLUMNS} more columns are in the values below")
            columns = columns[:MAX_COLUMNS]
    sec.tables.append(Table(title, [label, *columns], [[k, *(row.get(c) for c in columns)]
                                                        for k, row in cells.items()]))
    labels = list(cells)
    data = {c: [_magnitude(row.get(c)) for row in cells.values()] for c in columns}
    sec.charts += charts_for(title, labels, data, line=numeric_x and len(labels) >= 3,
                             series_by_rows=series_by_rows)


def charts_for(title: str, labels: list[str], data: dict[str, list[float | None]], *, line: bool = False,
               series_by_rows: bool = False) -> list[Chart]:
    """Charts of the columns that have a unit: one per unit, split where the columns' sizes differ
    by more than ``MAGNITUDE_SPLIT`` (decode tok/s next to prefill tok/s would be a flat line)."""
    by_unit: dict[str, list[str]] = {}
    for col, values in data.items():
        unit = unit_of(col)
        if unit is not None and any(v is not None for v in values):
            by_unit.setdefault(unit, []).append(col)
    charts = []
    for unit, cols in by_unit.items():
        peak = {c: max(abs(v) for v in data[c] if v is not None) for c in cols}
        groups: list[list[str]] = []
        for c in sorted(cols, key=lambda c: peak[c]):
            if groups and peak[c] <= MAGNITUDE_SPLIT * max(peak[groups[-1][0]], 1e-12):
                groups[-1].append(c)
            else:
                groups.append([c])
        for group in groups:
            group.sort(key=cols.index)
            name = f"{title}: {', '.join(group) if len(group) <= 3 else unit}"
            if series_by_rows:
                series = {lab: [data[c][i] for c in group] for i, lab in enumerate(labels[:MAX_SERIES])}
                charts.append(Chart(name, unit, group[:MAX_CATEGORIES], series))
            else:
                series = {c: data[c][:MAX_CATEGORIES] for c in group[:MAX_SERIES]}
                charts.append(Chart(name, unit, labels[:MAX_CATEGORIES], series, "line" if line else "bar"))
    return charts


def kv_table(sec: Section, title: str, d: dict) -> None:
    """A two-column table of a dict's leaves; lists of records (cases, failures) are left to the
    failure list and the file's full values."""
    rows = [[k, v] for k, v in row_cells(d).items()
            if not (isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v))]
    if rows:
        sec.tables.append(Table(title, ["", "value"], rows))


def _decode(doc: dict, sec: Section) -> None:
    keyed(sec, "Speed by implementation", doc["results"], "implementation", series_by_rows=True)


def _by_streams(doc: dict, sec: Section) -> None:
    keyed(sec, "By concurrent streams", doc["results"], "streams")


def _cache(doc: dict, sec: Section) -> None:
    keyed(sec, "Time to first token", doc["results"], "phase", name="time_ms")


def _agent(doc: dict, sec: Section) -> None:
    keyed(sec, "Agent turn, time to first token", doc["results"], "phase", name="ttft_ms")


def _spec(doc: dict, sec: Section) -> None:
    rows = {}
    for part, p in doc["parts"].items():
        if not isinstance(p, dict):
            continue
        speed, spec = p.get("decode_tok_s") or {}, p.get("speculation") or {}
        rows[part] = {"decode_tok_s.off": speed.get("off"), "decode_tok_s.on": speed.get("on"),
                      "speedup_ratio": p.get("ratio"), "acceptance": spec.get("acceptance_rate"),
                      "tokens_per_verify_step": spec.get("tokens_per_verify_step"),
                      "identical": p.get("identical"), "error": p.get("error")}
    keyed(sec, "Speculative decoding on vs off", rows, "part",
          columns=["decode_tok_s.off", "decode_tok_s.on", "speedup_ratio", "acceptance",
                   "tokens_per_verify_step", "identical", "error"])


def _spec_curve(doc: dict, sec: Section) -> None:
    rows = {r["k"]: {key: r.get(key) for key in ("drafts", "rows_fed", "path", "logit_rows")}
            | {"step_ms": r.get("ms"), "vs_k1_ratio": r.get("ratio")} for r in doc["results"]}
    keyed(sec, "Verify step time by rows fed", rows, "k")


def _structured(doc: dict, sec: Section) -> None:
    parts = doc["parts"]
    for name, p in parts.items():
        if not isinstance(p, dict):
            continue
        if "error" in p:
            kv_table(sec, f"{name}", {"error": p["error"]})
        elif name == "validity":
            kv_table(sec, "Validity", {k: v for k, v in p.items() if k not in ("by_kind", "counts")})
            if isinstance(p.get("by_kind"), dict):
                keyed(sec, "Validity by kind", p["by_kind"], "kind")
        elif name == "cost":
            keyed(sec, "Cost of the grammar mask", p["batches"], "batch")
        elif name == "jump":
            kv_table(sec, "Jump-forward", {k: p.get(k) for k in ("ratio", "target", "forced_share", "identical_text")})
            keyed(sec, "Jump-forward by schema", {s: {k: v for k, v in r.items() if k not in ("text", "seconds",
                                                                                              "prompt_ids_sha")}
                                                  for s, r in p.get("schemas", {}).items()}, "schema")
        elif name == "exact":
            keyed(sec, "Batch exactness", {m: {k: r.get(k) for k in ("same", "total", "jump_same")}
                                          for m, r in p.get("modes", {}).items()}, "weights")
        else:
            kv_table(sec, name, p)


def _gpu_ab(doc: dict, sec: Section) -> None:
    keyed(sec, "Head vs base", doc["summary"], "cell")


def _grammar_engines(doc: dict, sec: Section) -> None:
    engines = {k: v for k, v in doc.items() if isinstance(v, dict) and "mask" in v}
    keyed(sec, "Grammar engines", engines, "engine",
          columns=["setup_s", "mask.median_us", "mask.p90_us", "compile.median_us", "compile.p90_us",
                   "rejected_walks"])


def _gpu_stages(doc: dict, sec: Section) -> None:
    if isinstance(doc.get("runner"), list):
        sec.tables.append(Table("Runner", ["step"], [[line] for line in doc["runner"]]))


_BUILDERS = {"decode": _decode, "serve-load": _by_streams, "http": _by_streams, "cache": _cache, "agent": _agent,
             "spec": _spec, "spec-curve": _spec_curve, "structured": _structured, "gpu-ab": _gpu_ab,
             "grammar-engines": _grammar_engines, "gpu-stages": _gpu_stages}


def _walk_dicts(doc: Any, depth: int = 5):
    """(path, dict) for the dicts within ``depth`` levels of ``doc``, outermost first."""
    queue: list[tuple[str, Any, int]] = [("", doc, 0)]
    while queue:
        where, v, d = queue.pop(0)
        if isinstance(v, dict):
            yield where, v
            if d < depth:
                queue += [(f"{where}.{k}" if where else str(k), x, d + 1) for k, x in v.items()]


def _series_tables(doc: Any, sec: Section) -> None:
    """Unknown shapes: a table and line charts for each dict keyed by numbers (streams, batch sizes ...)."""
    found = 0
    for where, d in _walk_dicts(doc, 4):
        if len(d) >= 2 and all(_int_like(k) and isinstance(v, dict) for k, v in d.items()) and found < 4:
            keyed(sec, where or "values", d, where.rsplit(".", 1)[-1] or "key")
            found += 1


def _stage_charts(doc: Any, sec: Section) -> None:
    """GPU stage records (``{"cells": {...}, "errors": [...]}``, anywhere in a file): the tok/s of their cells."""
    for where, d in _walk_dicts(doc, 5):
        cells = d.get("cells")
        if not (isinstance(cells, dict) and "errors" in d):
            continue
        labels, values = [], []
        for cell, record in cells.items():
            for col, v in row_cells(record).items():
                x = _magnitude(v)
                if x is not None and unit_of(col) == "tok/s":
                    labels.append(f"{cell} · {col}")
                    values.append(x)
        if labels:
            for c in charts_for(where or "cells", labels, {"tok_s": values}):
                c.title = f"{where or 'cells'}: tok/s"
                sec.charts.append(c)


# -- HTML ----------------------------------------------------------------------------------------------
CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1100px;
color:#1d2330;padding:0 16px}
h1{font-size:22px}h2{font-size:17px;margin:32px 0 4px;border-top:1px solid #d8dce4;padding-top:16px}
h3{font-size:14px;margin:16px 0 4px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{border:1px solid #d8dce4;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f1f3f7}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.meta{color:#5a6275}.muted{color:#8a90a0}.bad{color:#b00020;font-weight:600}
.failures{background:#fdecee;border:1px solid #f3b7bf;color:#b00020;padding:8px 12px;margin:8px 0}
.failures li{margin:2px 0;word-break:break-word}.note{color:#8a5a00}
.chart{display:block;margin:8px 0 14px}.chart text{font-size:11px;fill:#1d2330}.chart .ct{font-size:12px;
font-weight:600}.chart .axis{stroke:#9aa1b0}.chart .grid{stroke:#e3e6ec}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f7f9;padding:6px;max-height:400px;overflow:auto}
.ok{color:#2e7d32}.wide{overflow-x:auto}
"""


def render_cell(v: Any, column: str = "") -> str:
    """One table cell (``<td>``), every string escaped."""
    if v is None:
        return '<td class="muted">–</td>'
    if isinstance(v, bool):
        bad = not v and column.rsplit(".", 1)[-1] in MUST_BE_TRUE
        return f'<td class="{"bad" if bad else ""}">{"yes" if v else "no"}</td>'
    if _is_number(v):
        return f'<td class="num">{fmt_number(v)}</td>'
    if is_stat(v):
        text = f"{fmt_number(v['median'])} [{fmt_number(v['min'])}–{fmt_number(v['max'])}]"
        return f'<td class="num" title="median [min–max]">{_esc(text)}</td>'
    if isinstance(v, str):
        bad = ' class="bad"' if column.rsplit(".", 1)[-1] in ERROR_KEYS and v else ""
        if len(v) <= CELL_CHARS:
            return f"<td{bad}>{_esc(v)}</td>"
        full = _cut(v, FULL_TEXT_CHARS)
        return (f"<td{bad}><details><summary>{_esc(_cut(v, CELL_CHARS))}</summary><pre>{_esc(full)}</pre>"
                "</details></td>")
    if isinstance(v, list) and not v:
        return '<td class="muted">none</td>'
    if isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v):
        shown = ", ".join(fmt_number(x) if _is_number(x) else str(x) for x in v[:12])
        more = f" … ({len(v)} in all)" if len(v) > 12 else ""
        bad = ' class="bad"' if column.rsplit(".", 1)[-1] in ERROR_KEYS else ""
        return f"<td{bad}>{_esc(_cut(shown, CELL_CHARS * 2) + more)}</td>"
    bad = ' class="bad"' if column.rsplit(".", 1)[-1] in ERROR_KEYS else ""
    return f"<td{bad}>{_esc(_short(v, CELL_CHARS))}</td>"


def render_table(t: Table) -> str:
    head = "".join(f"<th>{_esc(c)}</th>" for c in t.columns)
    body = []
    for row in t.rows:
        label, *rest = row
        body.append(f"<tr><th>{_esc(label)}</th>" + "".join(render_cell(v, c) for v, c in zip(rest, t.columns[1:]))
                    + "</tr>")
    caption = f"<h3>{_esc(t.title)}</h3>" if t.title else ""
    return (f'{caption}<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody>'
            "</table></div>")


def _legend(names: list[str], y: int) -> str:
    out, x = [], 0
    for i, name in enumerate(names):
        label = _cut(name, 40)
        out.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{PALETTE[i % len(PALETTE)]}"/>'
                   f'<text x="{x + 14}" y="{y}">{_esc(label)}</text>')
        x += 24 + 7 * len(label)
    return "".join(out)


def _svg_head(c: Chart, width: int, height: int) -> str:
    return (f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{_esc(c.title)}"><text class="ct" x="0" y="14">{_esc(c.title)} ({_esc(c.unit)})</text>')


def svg_bar(c: Chart) -> str:
    """Horizontal bars, one group per category and one bar per series."""
    names = list(c.series)
    label_w, plot_w, value_w, bar_h, gap = 300, 380, 90, 14, 8
    width = label_w + plot_w + value_w
    legend = 20 if len(names) > 1 else 0
    top = 26 + legend
    group_h = len(names) * bar_h + gap
    height = top + len(c.categories) * group_h + 6
    values = [v for vs in c.series.values() for v in vs if v is not None]
    vmax = max([abs(v) for v in values] + [1e-12])
    out = [_svg_head(c, width, height)]
    if legend:
        out.append(_legend(names, 34))
    for i, cat in enumerate(c.categories):
        y0 = top + i * group_h
        out.append(f'<text x="{label_w - 6}" y="{y0 + len(names) * bar_h / 2 + 4:.1f}" text-anchor="end">'
                   f'<title>{_esc(cat)}</title>{_esc(_cut_middle(cat, 48))}</text>')
        for j, name in enumerate(names):
            v = c.series[name][i] if i < len(c.series[name]) else None
            if v is None:
                continue
            w = max(1.0, abs(v) / vmax * plot_w)
            out.append(f'<rect x="{label_w}" y="{y0 + j * bar_h}" width="{w:.1f}" height="{bar_h - 2}" '
                       f'fill="{PALETTE[j % len(PALETTE)]}"><title>{_esc(name)}: {fmt_number(v)}</title></rect>'
                       f'<text x="{label_w + w + 4:.1f}" y="{y0 + j * bar_h + bar_h - 4}">{fmt_number(v)}</text>')
    out.append("</svg>")
    return "".join(out)


def svg_line(c: Chart) -> str:
    """Lines over evenly spaced x positions (the categories: stream counts, rows fed ...)."""
    names = list(c.series)
    width, height, left, right, bottom = 700, 260, 70, 20, 34
    top = 30 + (20 if len(names) > 1 else 0)
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for vs in c.series.values() for v in vs if v is not None]
    step = _nice_step(max(values + [0.0]) - min(values + [0.0]))
    lo = math.floor(min([0.0] + values) / step) * step
    hi = max(math.ceil(max(values + [0.0]) / step) * step, lo + step)
    n = len(c.categories)

    def x_at(i: int) -> float:
        return left + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    def y_at(v: float) -> float:
        return top + plot_h * (1 - (v - lo) / (hi - lo))

    out = [_svg_head(c, width, height)]
    if len(names) > 1:
        out.append(_legend(names, 34))
    for k in range(round((hi - lo) / step) + 1):
        v = lo + k * step
        y = y_at(v)
        out.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_number(v)}</text>')
    out.append(f'<line class="axis" x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}"/>')
    for i, cat in enumerate(c.categories):
        out.append(f'<text x="{x_at(i):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{_esc(_cut(cat, 14))}'
                   "</text>")
    for j, name in enumerate(names):
        color = PALETTE[j % len(PALETTE)]
        points = [(x_at(i), y_at(v), v) for i, v in enumerate(c.series[name]) if v is not None]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points)
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"><title>{_esc(name)}: {fmt_number(v)}'
                f"</title></circle>" for x, y, v in points]
    out.append("</svg>")
    return "".join(out)


def render_section(i: int, s: Section) -> str:
    out = [f'<section id="f{i}"><h2>{_esc(s.path)} <span class="meta">({_esc(s.kind)})</span></h2>']
    if s.meta:
        out.append('<p class="meta">' + " · ".join(f"{_esc(k)}: {_esc(v)}" for k, v in s.meta) + "</p>")
    if s.about:
        out.append(f"<p>{_esc(_cut(s.about, 2000))}</p>")
    if s.error:
        out.append(f'<div class="failures">{_esc(s.error)}</div></section>')
        return "".join(out)
    if s.failures:
        shown = s.failures[:MAX_FAILURES_SHOWN]
        more = len(s.failures) - len(shown)
        out.append(f'<div class="failures"><strong>{_plural(len(s.failures), "failure")}</strong><ul>'
                   + "".join(f"<li>{_esc(f)}</li>" for f in shown)
                   + (f"<li>… {more} more</li>" if more else "") + "</ul></div>")
    out += [f'<p class="note">{_esc(n)}</p>' for n in s.notes]
    out += [render_table(t) for t in s.tables]
    out += [svg_line(c) if c.kind == "line" else svg_bar(c) for c in s.charts]
    if s.flat:
        more = f", {s.flat_left_off} more not shown (see the file)" if s.flat_left_off else ""
        out.append(f"<details><summary>All values ({len(s.flat)}{more})</summary>"
                   + render_table(Table("", ["key", "value"], [[k, v] for k, v in s.flat])) + "</details>")
    out.append("</section>")
    return "".join(out)


def render_report(sections: list[Section], source: str, generated: str | None = None) -> str:
    """The whole page: a summary of every file with its status, then one section per file."""
    generated = generated or datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    failed = sum(1 for s in sections if s.failures or s.error)
    rows = []
    for i, s in enumerate(sections):
        if s.error:
            status = '<td class="bad">unreadable</td>'
        elif s.failures:
            status = f'<td class="bad">{_plural(len(s.failures), "failure")}</td>'
        else:
            status = '<td class="ok">ok</td>'
        model = dict(s.meta).get("model", "")
        rows.append(f'<tr><td><a href="#f{i}">{_esc(s.path)}</a></td><td>{_esc(s.kind)}</td><td>{_esc(model)}</td>'
                    f"{status}</tr>")
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>Lodestar benchmark report</title><style>{CSS}</style></head><body>"
            f"<h1>Lodestar benchmark report</h1><p class=\"meta\">{_plural(len(sections), 'result file')} from "
            f"{_esc(source)} · {failed} with failures · built {_esc(generated)}</p>"
            "<table><thead><tr><th>file</th><th>bench</th><th>model</th><th>status</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>"
            + "".join(render_section(i, s) for i, s in enumerate(sections)) + "</body></html>\n")


def build_report(root: Path) -> str:
    """The HTML report of every result JSON under ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise ReportError(f"{root} is not a folder: pass the folder that holds the benchmark result JSON files "
                          "(for example bench/results)")
    sections = load_sections(root)
    if not sections:
        raise ReportError(f"{root} holds no *.json result file: write results with a bench command's --json FILE")
    return render_report(sections, str(root))
