"""Other gateways, measured in the same runs as Inferplane's (``bench.overhead --litellm``).

Each peer lives in a virtualenv of its own under ``var/bench-peers/`` (made on first use: the
project never depends on it), and is pointed at the same engine as the gateway.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.harness import LOGS, ROOT, _spawn, free_port

# LiteLLM's proxy: the most-used open gateway in front of vLLM. 1.106.12 is the newest release
# whose ``[proxy]`` extra installs from PyPI alone (later ones need a ``litellm-proxy`` package
# that is not published there).
LITELLM_VERSION = "1.106.12"
LITELLM_KEY = "sk-bench-litellm"  # its master key: it refuses to start without one


def litellm_venv() -> Path:
    """The peer's own virtualenv (created and installed once, about 3 minutes, ~750 MB)."""
    venv = ROOT / "var" / "bench-peers" / f"litellm-{LITELLM_VERSION}"
    if not (venv / ".installed").exists():
        print(f"installing LiteLLM {LITELLM_VERSION} into {venv.relative_to(ROOT)} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, f"litellm[proxy]=={LITELLM_VERSION}"], check=True)
        (venv / ".installed").touch()
    return venv


def start_litellm(engine_url: str, *, workers: int) -> tuple[subprocess.Popen[bytes], str]:
    """LiteLLM's proxy with ``workers`` processes in front of the engine (its OpenAI-compatible
    vLLM provider), no database; returns the process and the proxy's URL."""
    venv = litellm_venv()
    port = free_port()
    LOGS.mkdir(parents=True, exist_ok=True)
    config = LOGS / f"litellm-{port}.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: tiny-chat\n"
        "    litellm_params:\n"
        "      model: hosted_vllm/tiny-chat\n"
        f"      api_base: {engine_url}/v1\n"
        "      api_key: none\n"
    )
    command = [str(venv / "bin" / "litellm"), "--config", str(config), "--port", str(port)]
    command += ["--num_workers", str(workers)]
    # Not the bench's database or Redis: with DATABASE_URL set it would want its own schema.
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env |= {"LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    with (LOGS / f"litellm-{port}.log").open("wb") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    _wait_ready(process, f"{url}/health/liveliness", f"litellm-{port}", ok=(200,))
    return process, url


def _wait_ready(
    process: subprocess.Popen[bytes], url: str, name: str, *, ok: tuple[int, ...]
) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{name} exited; see {LOGS / f'{name}.log'}")
        try:
            if httpx.get(url, timeout=1).status_code in ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{name} not ready after 120 s; see {LOGS / f'{name}.log'}")


def start_floor(
    engine_url: str, *, workers: int, cpus: str = ""
) -> tuple[subprocess.Popen[bytes], str]:
    """``bench.floor_relay`` under uvicorn with ``workers`` processes, as the gateway runs
    (``cpus``: pinned where the gateway is)."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "uvicorn"), "bench.floor_relay:app"]
    command += ["--port", str(port), "--workers", str(workers), "--no-access-log"]
    command += ["--lifespan", "off"]
    process = _spawn(f"floor-{port}", command, {"ENGINE_URL": engine_url}, cpus=cpus)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(process, f"{url}/health", f"floor-{port}", ok=(200, 404, 405))
    return process, url
