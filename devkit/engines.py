"""Local vLLM CPU engines, started the way `make run` starts them."""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def engine_command(port: int, *extra_args: str) -> str:
    """The shell command that starts an engine, as a Procfile line does."""
    return shlex.join([str(ROOT / "scripts" / "engine.sh"), str(port), *extra_args])
