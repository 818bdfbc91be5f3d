"""``GET /report``: the benchmark report of the server's results folder, the same page
``lodestar bench report DIR`` writes.

The folder is ``app.state.bench_results`` (set from ``lodestar serve --bench-results DIR``);
without it, the ``bench/results`` folder of a source checkout when there is one.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from lodestar.serve.errors import APIError

router = APIRouter(tags=["Web app"])

CHECKOUT_RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"


def results_dir(request: Request) -> Path:
    """The folder the report reads; 404 with the fix when there is none."""
    chosen = getattr(request.app.state, "bench_results", None)
    folder = Path(chosen) if chosen is not None else CHECKOUT_RESULTS
    if not folder.is_dir():
        where = f"{folder} is not a folder" if chosen is not None else "this installation has no bench/results folder"
        raise APIError(404, f"No benchmark results to report: {where}. Start the server with --bench-results DIR "
                            "(a folder of result JSON files written by lodestar bench ... --json FILE).",
                       code="no_bench_results")
    return folder


@router.get("/report", include_in_schema=False)   # a page, like /
async def get_report(request: Request) -> HTMLResponse:
    # Imported when asked for: the report reads JSON only, and most servers never build it.
    from lodestar.serve.web.report_html import ReportError, build_report

    folder = results_dir(request)
    try:
        page = await asyncio.to_thread(build_report, folder)     # reads every file: keep the event loop free
    except ReportError as e:
        raise APIError(404, str(e), code="no_bench_results") from None
    return HTMLResponse(page)
