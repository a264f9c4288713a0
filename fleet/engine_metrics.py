"""What we read from a vLLM engine's Prometheus ``/metrics``: the few series the control
plane uses (health probes: is it making progress; reconciliation: its token counters)."""

from __future__ import annotations

WANTED = {
    "vllm:prompt_tokens_total": "prompt",
    "vllm:generation_tokens_total": "generation",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "process_start_time_seconds": "started",
}


def engine_metrics_parse(text: str) -> dict[str, float]:
    """The wanted series, summed over their label sets (the process start is one gauge).
    ValueError when the token counters are missing (not a vLLM engine)."""
    values = dict.fromkeys(WANTED.values(), 0.0)
    seen = set()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        field = WANTED.get(name)
        if field:
            value = float(line.rsplit(" ", 1)[1])
            values[field] = value if field == "started" else values[field] + value
            seen.add(field)
    if not {"prompt", "generation"} <= seen:
        raise ValueError("the engine's /metrics has no vLLM token counters")
    return values
