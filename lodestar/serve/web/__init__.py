"""The web app's JSON routes under ``/api/``: one module per area, each with its own ``router``,
combined here into the one ``router`` that ``build_app`` registers."""
from fastapi import APIRouter

from lodestar.serve.web import agent_api, conversations, models_api, report, stats_api

router = APIRouter()
router.include_router(conversations.router)
router.include_router(stats_api.router)
router.include_router(report.router)
router.include_router(agent_api.router)
router.include_router(models_api.router)
