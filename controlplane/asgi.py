"""ASGI entry point: Channels' router takes the data plane before Django's HTTP app.

``/v1/*`` is served by plain ASGI apps (``inference.gateway.v1``: no sync middleware, no
thread hops) but for ``/v1/files`` and ``/v1/batches``; those and everything else
(dashboard, control API, admin) are Django's ASGI handler.
"""

import os
import threading
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from batches.asgi import KeyFirst  # noqa: E402
from controlplane import collector  # noqa: E402
from controlplane.bodylimit import BoundedBody  # noqa: E402
from controlplane.metrics import MetricsConsumer  # noqa: E402
from controlplane.signedin import SignedInFirst  # noqa: E402
from inference.gateway.routing import http_urlpatterns, websocket_urlpatterns  # noqa: E402
from moderation.classifier import classifier  # noqa: E402
from moderation.v1 import ModerationsConsumer  # noqa: E402


def _load_classifier() -> None:
    classifier()
    collector.freeze()  # the model is kept for the process's life too


# The embedded moderation classifier loads in the background (about a second): the first
# moderated request of this process does not wait for it.
threading.Thread(target=_load_classifier, name="load-moderation-classifier", daemon=True).start()

# Django's app for every request the consumers do not take, bodies bounded first.
django_bounded: Any = BoundedBody(django_asgi_app)  # type: ignore[arg-type]
# The Files and Batch APIs: the key checked from the headers before that (batches.asgi).
files_api: Any = KeyFirst(django_bounded)
# Everything else; a LoRA upload's sender checked from the headers first (controlplane.signedin).
django_rest: Any = SignedInFirst(django_bounded)

application = ProtocolTypeRouter(
    {
        "http": URLRouter(
            [
                # The Files and Batch APIs are Django's (uploads spool to disk as they come).
                re_path(r"^v1/(files|batches)(/|$)", files_api),
                path("v1/moderations", ModerationsConsumer.as_asgi()),
                path("metrics", MetricsConsumer.as_asgi()),
                *http_urlpatterns,
                re_path(r"", django_rest),
            ]
        ),
        # /v1/ws only, authenticated by API key: the dashboard's live parts poll over HTTP.
        "websocket": URLRouter(websocket_urlpatterns),
    }
)

# Everything this process keeps for its life is imported: out of the collector's way from now
# on (controlplane.collector).
collector.tune()
