import logging.config
import os
from typing import Any

from celery import Celery
from celery.signals import setup_logging

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

if os.environ.get("INFERPLANE_LOG_FORMAT") == "json":

    @setup_logging.connect
    def _logging(**kwargs: Any) -> None:
        """JSON logs: the workers and beat log through settings.LOGGING, as the web does,
        instead of Celery's own plain-text set-up."""
        from django.conf import settings

        logging.config.dictConfig(settings.LOGGING)
