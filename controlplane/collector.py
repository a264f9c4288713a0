"""The cyclic garbage collector, tuned for a web process (``controlplane.asgi`` calls ``tune``).

Python's default (a young collection every 700 container objects allocated net, a full one
every 100 of those) suits small scripts. A web process holds a couple of hundred thousand
tracked objects from the moment it has imported Django and the app, and a full collection
walks them all with the event loop stopped, every few seconds under load, every request in
flight waiting (measured: bench/RESULTS.md, the embeddings section). A request's objects
are freed by reference counting as it ends, so collecting seldom leaves little behind:

- ``gc.freeze()`` once the app is imported, and again once the moderation classifier has
  loaded in the background: what the process keeps for its whole life (modules, Django's
  settings and URL resolvers, the app's classes, the model) moves to a generation no
  collection walks;
- a young collection every ``YOUNG`` allocations (not 700), and the older generations
  after ``OLDER`` of the generation below (not 10): cycles are still found, in a heap with
  little in it to walk.
"""

from __future__ import annotations

import gc

YOUNG = 10_000
OLDER = 20


def tune() -> None:
    """Freeze what the process holds so far and collect less often (call once imported)."""
    freeze()
    gc.set_threshold(YOUNG, OLDER, OLDER)


def freeze() -> None:
    """Out of every collection's way: what the process holds now (it keeps it for life)."""
    gc.collect()  # what is garbage now is not frozen with the rest
    gc.freeze()
