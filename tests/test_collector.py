"""The web process keeps the cyclic garbage collector out of its way (controlplane.collector):
what it imported is frozen, and collections come seldom. Without it, a full collection walks
the whole app's heap (~160 ms, every few seconds under load) while every request waits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from controlplane import collector

PROBE = """
import gc, json, threading
import controlplane.asgi
for thread in threading.enumerate():
    if thread.name == "load-moderation-classifier":
        thread.join(60)
print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                  "tracked": len(gc.get_objects())}))
"""


def test_the_web_process_freezes_what_it_imported_and_collects_seldom() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    state = json.loads(out.stdout.strip().splitlines()[-1])
    assert state["threshold"] == [collector.YOUNG, collector.OLDER, collector.OLDER]
    # Django, the app and the classifier are frozen: far more than a collection still walks.
    assert state["frozen"] > 50_000
    assert state["tracked"] < state["frozen"] / 10
