"""``python manage.py run_drains``: the drains process (``controlplane.drains``)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand

from controlplane.drains import drains_all, drains_run


class Command(BaseCommand):
    help = (
        "Move what the gateways leave in Redis (usage records, moderation events, budget "
        "notices) into Postgres as it arrives, and retry key-cache invalidations; runs until "
        "SIGTERM or Ctrl-C. Any number may run."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        drains_run(drains_all(stop), stop)
