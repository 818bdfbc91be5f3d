"""``lodestar bench report DIR [-o FILE]``: the benchmark report page
(``lodestar.serve.web.report_html``) written to a file."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lodestar.serve.web.report_html import ReportError, build_report, result_files


def main(a: argparse.Namespace) -> int:
    try:
        page = build_report(a.dir)
    except ReportError as e:
        print(f"lodestar: error: {e}", file=sys.stderr)
        return 2
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    print(f"wrote {out} ({len(page) / 1024:.0f} KiB, {len(result_files(Path(a.dir)))} result files)")
    return 0
