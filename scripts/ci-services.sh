#!/usr/bin/env bash
# Services the test suite needs beyond Python packages, installed from Debian's packages:
# redis-server (the shared response store and rollout state tests, tests/redis_server.py).
# Idempotent; run by .ci/run before `make test`. The tests start and stop their own servers.
set -euo pipefail
if ! command -v redis-server >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
redis-server --version
