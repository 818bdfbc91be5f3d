"""``GET /api/stats``: the dashboard's live view of the server -- engine load, counters since
start, recent rates and the last finished requests -- read from the server's own ``Metrics``."""
from __future__ import annotations

import dataclasses
import statistics
import time

from fastapi import APIRouter, Request

from lodestar.serve.metrics import Metrics
from lodestar.serve.state import get_state

router = APIRouter(tags=["Web app"])

TTFT_SAMPLE = 50          # the TTFT median covers this many most recent requests
ENGINE_KEYS = ("waiting", "running", "kv_blocks_used", "kv_blocks_total")


def stats_document(metrics: Metrics, engine_stats: dict, now: float | None = None) -> dict:
    """The ``/api/stats`` body; ``requests`` lists the newest first."""
    recent = list(metrics.recent)
    ttfts = [r.ttft_ms for r in recent[-TTFT_SAMPLE:] if r.ttft_ms is not None]
    return {
        "time": time.time() if now is None else now,
        "engine": {key: int(engine_stats.get(key, 0) or 0) for key in ENGINE_KEYS},
        "counters": {"requests": metrics.finished_count, "prompt_tokens": metrics.prompt_tokens,
                     "generation_tokens": metrics.generation_tokens, "cached_tokens": metrics.cached_tokens,
                     "forced_tokens": metrics.forced_tokens, "spec_drafted": metrics.spec_drafted,
                     "spec_accepted": metrics.spec_accepted},
        # Numbers even before the first request, so a chart never has to special-case null.
        "rates": {"decode_tok_s": metrics.decode_rate.rate(),
                  "ttft_ms_p50": statistics.median(ttfts) if ttfts else 0.0},
        "prefix_cache_hit_rate": metrics.cached_tokens / metrics.prompt_tokens if metrics.prompt_tokens else 0.0,
        "spec_acceptance": metrics.spec_accepted / metrics.spec_drafted if metrics.spec_drafted else None,
        "requests": [dataclasses.asdict(r) for r in reversed(recent)],
    }


@router.get("/api/stats", summary="Live server statistics for the dashboard")
async def get_stats(request: Request) -> dict:
    state = get_state(request)
    engine = state.engine
    # No engine while no model is loaded: the dashboard still shows the counters.
    engine_stats = engine.stats() if engine is not None else {}
    return stats_document(state.metrics, engine_stats)
