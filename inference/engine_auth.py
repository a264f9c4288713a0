"""The engines' API key (vLLM ``--api-key``): what every request of ours to an engine sends.

Engines inside a cluster must not answer whoever reaches them: they are started with the key
from a secret (``VLLM_API_KEY``), and the gateway, the workers and the probes send it from
``INFERPLANE_ENGINE_API_KEY``. vLLM checks it under ``/v1`` and ``/inference`` (where
``--enable-scale-out`` serves the abort by request id the gateway uses, beside its token-level
generate and render routes); its ``/health``, ``/metrics`` and a few other routes stay open,
so the deployment also lets only the web and worker pods reach the engines (``platform/``,
NetworkPolicy).
"""

from __future__ import annotations

from django.conf import settings


def engine_auth_headers() -> dict[str, str]:
    key = settings.INFERPLANE_ENGINE_API_KEY
    return {"authorization": f"Bearer {key}"} if key else {}
