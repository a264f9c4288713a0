#!/bin/sh
# preStop hook of the vLLM engine pods: leave the pool before the engine stops.
#
# 1. Wait (at most DRAIN_DNS_SECONDS) until this pod's address (POD_IP) has left the
#    headless Service's DNS name (DRAIN_SERVICE): a terminating pod is no longer "ready",
#    so the Service stops publishing it.
# 2. Wait DRAIN_PROBE_SECONDS (the control plane's probe interval and a margin): its next
#    probe round no longer finds the address and marks the replica draining, so no new
#    request is sent here.
# 3. Wait (at most DRAIN_IDLE_SECONDS) until the engine's own /metrics shows nothing
#    running or waiting (vllm:num_requests_running, vllm:num_requests_waiting).
#
# Then the kubelet sends SIGTERM and vLLM's --shutdown-timeout lets anything still running
# finish. terminationGracePeriodSeconds covers all of it (tests/test_deployment_files.py
# checks the sum). Every step is bounded, and a failure in one only moves on to the next.
exec python3 - <<'PYTHON'
import os
import socket
import time
import urllib.request

ip = os.environ.get("POD_IP", "")
service = os.environ.get("DRAIN_SERVICE", "")
port = os.environ.get("DRAIN_ENGINE_PORT", "8000")


def log(message):
    print(f"drain: {message}", flush=True)


def addresses(name):
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return set()  # no address at all: ours is gone too


deadline = time.monotonic() + float(os.environ.get("DRAIN_DNS_SECONDS", "30"))
while ip and service and time.monotonic() < deadline and ip in addresses(service):
    time.sleep(1)
log(f"{ip} out of {service}" if ip not in addresses(service) else "still in DNS; going on")

time.sleep(float(os.environ.get("DRAIN_PROBE_SECONDS", "15")))


def busy():
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (localhost)
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in {"vllm:num_requests_running", "vllm:num_requests_waiting"}:
            total += float(line.rsplit(" ", 1)[1])  # summed over engines and models
    return total


deadline = time.monotonic() + float(os.environ.get("DRAIN_IDLE_SECONDS", "120"))
left = None
while time.monotonic() < deadline:
    try:
        left = busy()
    except (OSError, ValueError) as exc:
        log(f"cannot read /metrics ({exc}); stopping")
        break
    if left == 0:
        break
    time.sleep(1)
log(f"requests running or waiting: {left}")
PYTHON
