"""Local vLLM CPU engines, started the way `make run` starts them."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def engine_command(port: int, *extra_args: str) -> str:
    """The shell command that starts an engine, as a Procfile line does."""
    return shlex.join([str(ROOT / "scripts" / "engine.sh"), str(port), *extra_args])


def guard_model_dir() -> str:
    """Where ``make setup`` put the tiny guard model (the Makefile exports it)."""
    cache = os.environ.get("INFERPLANE_CACHE", str(Path.home() / ".cache" / "inferplane"))
    return os.environ.get("GUARD_MODEL_DIR", f"{cache}/models/tiny-guard-v1")


def guard_engine_command(port: int, *extra_args: str) -> str:
    """The guard engine's command, as the Procfile's ``engine-guard`` line runs it."""
    env = shlex.join([f"MODEL_DIR={guard_model_dir()}", "SERVED_MODEL_NAME=tiny-guard"])
    return f"env {env} {engine_command(port, *extra_args)}"


# The tiny chat checkpoint served as an embedding model: vLLM's pooling runner converts it
# (mean of the last hidden states, normalized), on an engine of its own (one runner each).
EMBED_ENGINE_ARGS = ("--runner", "pooling", "--convert", "embed")


def embed_engine_command(port: int, *extra_args: str) -> str:
    """The embedding engine's command, as the Procfile's ``engine-embed`` line runs it."""
    env = shlex.join(["SERVED_MODEL_NAME=tiny-embed"])
    return f"env {env} {engine_command(port, *EMBED_ENGINE_ARGS, *extra_args)}"
