"""Priority classes: which requests a full pool admits first (docs/priority.md).

A tenant has a class (the platform's operator sets it: it is a tier of service, and it can
carry its own price); each of its keys may be narrowed to a lower one; a request may ask for a
lower class than its key's, never a higher one. Admission serves the classes' bands in strict
order, fair by tokens inside each band, with a starvation guard for the lower ones
(``inference.gateway.admission``).
"""

from __future__ import annotations

from django.db import models


class PriorityClass(models.TextChoices):
    # In band order: the first is admitted first.
    INTERACTIVE = "interactive", "Interactive: admitted first"
    STANDARD = "standard", "Standard"
    BACKGROUND = "background", "Background: admitted when nothing above waits"


PRIORITY_CLASSES: tuple[str, ...] = tuple(PriorityClass.values)
DEFAULT_CLASS = PriorityClass.STANDARD.value
# Batch lines run in the lowest band: offline work never goes before a waiting online request.
BATCH_CLASS = PriorityClass.BACKGROUND.value

# OpenAI's ``service_tier`` names for the classes, which a request may send instead of ours
# (``auto``: the key's own class).
SERVICE_TIERS = {
    "priority": PriorityClass.INTERACTIVE.value,
    "default": PriorityClass.STANDARD.value,
    "flex": PriorityClass.BACKGROUND.value,
}


def band(name: str) -> int:
    """A class's admission band (0 is served first)."""
    return PRIORITY_CLASSES.index(name)


def lowest(*names: str) -> str:
    """The lowest of some classes (a key narrows its tenant's, never raises it)."""
    return max(names, key=band)
