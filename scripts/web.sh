#!/bin/sh
# The web server: uvicorn serving controlplane.asgi, with the metrics and log set-up it
# needs. scripts/web.sh [uvicorn options...]. Used by `make run` (Procfile), the tests' live
# stack, the image and the Kubernetes manifests, so all of them run the gateway one way.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
workers="${WEB_CONCURRENCY:-1}"
previous=""
for arg in "$@"; do
  [ "$previous" = "--workers" ] && workers="$arg"
  case "$arg" in --workers=*) workers="${arg#--workers=}" ;; esac
  previous="$arg"
done
# Several worker processes each write their metrics to files in one directory, and a scrape
# of any of them sums them all (prometheus_client's multiprocess mode). The directory must
# start empty: a file left by an earlier server would count its requests again.
if [ -z "${PROMETHEUS_MULTIPROC_DIR:-}" ] && [ "$workers" -gt 1 ]; then
  export PROMETHEUS_MULTIPROC_DIR="${TMPDIR:-/tmp}/inferplane-metrics-$$"
fi
if [ -n "${PROMETHEUS_MULTIPROC_DIR:-}" ]; then
  rm -rf "$PROMETHEUS_MULTIPROC_DIR"
  mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
fi
# JSON logs (INFERPLANE_LOG_FORMAT=json): uvicorn's own lines too, from its first one.
if [ "${INFERPLANE_LOG_FORMAT:-plain}" = "json" ]; then
  set -- --log-config "$here/uvicorn-json-logging.json" "$@"
fi
exec uvicorn controlplane.asgi:application "$@"
