#!/usr/bin/env bash
# The compose stack built and run for real, end to end (docs/docker.md, "Smoke test"):
#
#   make compose-smoke            # or: bash scripts/compose-smoke.sh
#
# 1. picks a container engine: docker (with a reachable daemon) or podman; installs podman
#    (Debian packages) and podman-compose (PyPI, into .venv) when neither works;
# 2. validates compose.yaml (alone and with compose.gpu.yaml) with `docker-compose config`;
# 3. builds the cpu image; the base image is PYTHON_IMAGE when it can be pulled, else one made
#    from Debian packages with debootstrap; a torch wheel pip already has on this machine
#    goes in through LOCAL_WHEELS; Prometheus is the official image or, when that cannot be
#    pulled, Debian's `prometheus` package (deploy/prometheus/Dockerfile.debian);
# 4. starts engine-orca and engine-static, then the gateway, then Prometheus, each once the
#    ones before are healthy (compose.yaml's healthchecks), all published on 127.0.0.1;
#    each engine's log must show `cpu_kernels_ready` and no build at start-up;
# 5. sends OpenAI SDK requests through the gateway (chat, streaming, each arm through
#    X-Carousel-Arm, sticky users), checks the per-arm series in the gateway's /metrics,
#    every Prometheus target up with per-arm and per-engine series, and the Grafana dashboard
#    (its datasource and every query's metrics against live scrapes and Prometheus);
# 6. tears everything down (containers, pods, networks, volumes) on success or failure.
#
# Knobs (environment):
#   CAROUSEL_SMOKE_ENGINE        docker | podman (default: the first that works)
#   CAROUSEL_SMOKE_PROJECT       compose project name (default carousel-smoke-<pid>)
#   CAROUSEL_SMOKE_HEALTH_TIMEOUT_S  per stage, to healthy (default 1200)
#   CAROUSEL_SMOKE_BUILD_TIMEOUT_S   image builds (default 2400)
#   CAROUSEL_SMOKE_CHECK_TIMEOUT_S   how long Prometheus's targets, series and each dashboard
#                                panel may take to show the traffic (default 120; polled)
#   CAROUSEL_SMOKE_OUT           logs and summary (default out/compose-smoke)
#   CAROUSEL_SMOKE_REMOVE_IMAGES 1: also remove the images this run built (default 0: kept,
#                                so the next run reuses their layers)
#   CAROUSEL_SMOKE_INSTALL       0: never install anything (default 1)
#   CAROUSEL_SMOKE_BREAK         break one thing on purpose, to see the smoke fail:
#       engine-unreachable  the gateway's `static` arm points at a port no engine listens on
#       arm-missing         no traffic is sent to the `static` arm
#       unhealthy           engine-static's healthcheck probes a port nothing listens on
#   PYTHON_IMAGE, PIP_INDEX_URL, TORCH_INDEX_URL, LOCAL_WHEELS  Dockerfile build args
#   CAROUSEL_IMAGE               the Carousel image tag (default carousel:cpu)
set -euo pipefail
# NOTE: all of it is one { ... } block, read whole before it runs: editing this file while a
# smoke runs does not change the running one
{
cd "$(dirname "$0")/.."
ROOT=$PWD

PROJECT=${CAROUSEL_SMOKE_PROJECT:-carousel-smoke-$$}
HEALTH_TIMEOUT_S=${CAROUSEL_SMOKE_HEALTH_TIMEOUT_S:-1200}
BUILD_TIMEOUT_S=${CAROUSEL_SMOKE_BUILD_TIMEOUT_S:-2400}
# what the checks wait for, once the stack is healthy: an engine's kernels line in its log, and
# each of Prometheus's targets, series and dashboard panels (it scrapes every 5 s)
KERNELS_TIMEOUT_S=120
CHECK_TIMEOUT_S=${CAROUSEL_SMOKE_CHECK_TIMEOUT_S:-120}
OUT=${CAROUSEL_SMOKE_OUT:-$ROOT/out/compose-smoke}
BREAK=${CAROUSEL_SMOKE_BREAK:-}
INSTALL=${CAROUSEL_SMOKE_INSTALL:-1}
IMAGE=${CAROUSEL_IMAGE:-carousel:cpu}
PYTHON_IMAGE=${PYTHON_IMAGE:-docker.io/library/python:3.11-slim-bookworm}
OFFICIAL_PROMETHEUS=docker.io/prom/prometheus:v2.53.0
DEBOOTSTRAP_BASE=carousel-base:bookworm-debootstrap
PROMETHEUS_STANDIN=carousel-prometheus:debian
PODMAN_COMPOSE_VERSION=1.6.0
TORCH_VERSION=2.13.0
PY=${PYTHON:-$ROOT/.venv/bin/python}
CHECKS="$ROOT/scripts/compose_smoke.py"

case "$BREAK" in "" | engine-unreachable | arm-missing | unhealthy) ;;
  *) echo "CAROUSEL_SMOKE_BREAK=$BREAK: expected engine-unreachable, arm-missing or unhealthy" >&2
     exit 2 ;;
esac
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/carousel-smoke.XXXXXX")
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
T0=$SECONDS

log() { printf '[compose-smoke %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
note() { printf '%s\n' "$*" >> "$SUMMARY"; log "$*"; }
FAILED=""
fail() {
  FAILED="$*"
  printf '\ncompose smoke: FAIL: %s\n' "$*" >&2
  printf 'FAIL: %s\n' "$*" >> "$SUMMARY"
  exit 1
}
have() { command -v "$1" >/dev/null 2>&1; }

[ -x "$PY" ] || fail "no $PY with the OpenAI SDK: run \`make install\` first (or set PYTHON)"

# -- 1. the container engine and its compose ------------------------------------------------

ENGINE=""
COMPOSE=()
engine_works() {  # a client that reaches its engine (a docker CLI without a daemon does not)
  case "$1" in
    docker) have docker && timeout 20 docker info >/dev/null 2>&1 ;;
    podman) have podman && timeout 30 podman info >/dev/null 2>&1 ;;
  esac
}
apt_install() {
  [ "$INSTALL" = 1 ] || fail "$* missing and CAROUSEL_SMOKE_INSTALL=0"
  have apt-get || fail "$* missing and no apt-get to install it with"
  [ "$(id -u)" = 0 ] || fail "$* missing: install it (apt-get install $*) or run as root"
  log "installing Debian packages: $*"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" > "$WORK/apt.log" 2>&1; then
    timeout 300 apt-get update -q >> "$WORK/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >> "$WORK/apt.log" 2>&1 \
      || fail "apt-get install $* failed: $(tail -3 "$WORK/apt.log")"
  fi
}
pick_engine() {
  local want=${CAROUSEL_SMOKE_ENGINE:-}
  if [ -n "$want" ]; then
    [ "$want" = podman ] && ! have podman && apt_install podman
    engine_works "$want" || fail "CAROUSEL_SMOKE_ENGINE=$want, but \`$want info\` fails"
    ENGINE=$want
  elif engine_works docker; then
    ENGINE=docker
  elif engine_works podman; then
    ENGINE=podman
  else
    have docker && log "docker is installed but reaches no daemon; using podman"
    apt_install podman
    engine_works podman || fail "podman installed, but \`podman info\` fails"
    ENGINE=podman
  fi
  if [ "$ENGINE" = docker ]; then
    if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
    elif have docker-compose; then COMPOSE=(docker-compose)
    else fail "docker works but has no compose (install the Compose plugin)"; fi
  else
    local pc
    pc=$(command -v podman-compose || true)
    [ -n "$pc" ] || pc=$(dirname "$PY")/podman-compose
    if [ ! -x "$pc" ]; then
      [ "$INSTALL" = 1 ] || fail "podman-compose missing and CAROUSEL_SMOKE_INSTALL=0"
      log "installing podman-compose==$PODMAN_COMPOSE_VERSION from PyPI into $(dirname "$(dirname "$PY")")"
      "$PY" -m pip install -q "podman-compose==$PODMAN_COMPOSE_VERSION" > "$WORK/pip.log" 2>&1 \
        || fail "pip install podman-compose failed: $(tail -3 "$WORK/pip.log")"
    fi
    COMPOSE=("$pc")
  fi
  note "engine: $ENGINE ($($ENGINE --version | head -1)); compose: ${COMPOSE[*]##*/}"
}

# podman on some hosts (cgroup v1 hybrid, a low RLIMIT_NOFILE hard limit, no systemd) cannot
# start a container with its defaults: runc/crun refuse the default rlimits. The fix is a
# containers.conf with `default_ulimits = []` (and runc where crun cannot run): this run uses
# its own, through CONTAINERS_CONF, and leaves the system's alone.
podman_conf() {  # $1: an image to probe with
  timeout 120 podman run --rm "$1" true > "$WORK/probe.log" 2>&1 && return 0
  log "podman cannot run a container with its defaults: $(tail -1 "$WORK/probe.log")"
  local conf="$WORK/containers.conf" runtime
  for runtime in "" runc; do
    printf '[containers]\ndefault_ulimits = []\n' > "$conf"
    if [ -n "$runtime" ]; then
      have "$runtime" || continue
      printf '[engine]\nruntime = "%s"\n' "$runtime" >> "$conf"
    fi
    if CONTAINERS_CONF=$conf timeout 120 podman run --rm "$1" true >> "$WORK/probe.log" 2>&1; then
      export CONTAINERS_CONF=$conf
      note "podman: containers.conf with default_ulimits = []${runtime:+ and runtime = $runtime}"
      return 0
    fi
  done
  fail "podman cannot run containers here: $(tail -2 "$WORK/probe.log")"
}

# -- teardown: everything this run started, on any exit --------------------------------------

UP=0
project_ids() {  # $1: ps | pod | network | volume
  local label="label=com.docker.compose.project=$PROJECT"
  {
    case "$1" in
      ps) $ENGINE ps -a -q --filter "$label"
          if [ "$ENGINE" = podman ]; then
            $ENGINE ps -a -q --filter "label=io.podman.compose.project=$PROJECT"
          fi ;;
      pod) if [ "$ENGINE" = podman ]; then $ENGINE pod ps -q --filter "name=^pod_${PROJECT}\$"; fi ;;
      network) $ENGINE network ls -q --filter "name=^${PROJECT}_" ;;
      volume) $ENGINE volume ls -q --filter "name=^${PROJECT}_" ;;
    esac
  } 2>/dev/null | sort -u || true
}
teardown() {
  local rc=$? ids left=""
  set +e  # NOTE: teardown goes on through every step, whatever one of them says
  trap - EXIT INT TERM
  if [ "$UP" = 1 ]; then
    for svc in engine-orca engine-static gateway prometheus; do
      ids=$(service_id "$svc" 2>/dev/null || true)
      [ -n "$ids" ] && $ENGINE logs "$ids" > "$OUT/$svc.log" 2>&1 || true
    done
    if [ "$rc" != 0 ]; then
      for svc in engine-orca engine-static gateway prometheus; do
        [ -s "$OUT/$svc.log" ] || continue
        echo "--- $svc (last lines; all in $OUT/$svc.log)" >&2
        tr '\r' '\n' < "$OUT/$svc.log" | grep -v '^[[:space:]]*$' | tail -n 6 | cut -c1-240 >&2
      done
    fi
    log "teardown: ${COMPOSE[*]##*/} down -v"
    timeout 180 "${COMPOSE[@]}" "${COMPOSE_FILES[@]}" down -v --timeout 10 > "$WORK/down.log" 2>&1 \
      || log "compose down failed ($(tail -1 "$WORK/down.log")); removing by id"
    # whatever compose left: by the project's labels and names, never anything else
    ids=$(project_ids ps); [ -n "$ids" ] && $ENGINE rm -f $ids >/dev/null 2>&1
    ids=$(project_ids pod); [ -n "$ids" ] && $ENGINE pod rm -f $ids >/dev/null 2>&1
    ids=$(project_ids volume); [ -n "$ids" ] && $ENGINE volume rm -f $ids >/dev/null 2>&1
    ids=$(project_ids network); [ -n "$ids" ] && $ENGINE network rm $ids >/dev/null 2>&1
    for kind in ps pod volume network; do
      ids=$(project_ids $kind)
      [ -n "$ids" ] && left="$left $kind:$(echo $ids)"
    done
  fi
  if [ "${CAROUSEL_SMOKE_REMOVE_IMAGES:-0}" = 1 ] && [ -n "${BUILT_IMAGES:-}" ]; then
    $ENGINE rmi $BUILT_IMAGES > /dev/null 2>&1 || true
    log "removed images:$BUILT_IMAGES"
  fi
  rm -rf "$WORK"
  if [ -n "$left" ]; then
    printf 'compose smoke: FAIL: teardown left%s\n' "$left" >&2
    rc=1
  elif [ "$UP" = 1 ]; then
    note "teardown: no container, pod, network or volume of project $PROJECT left"
  fi
  case "$rc" in
    0) note "compose smoke: PASS in $((SECONDS - T0)) s" ;;
    130 | 143) printf 'compose smoke: interrupted (signal); torn down\n' >&2 ;;
    *) printf '\ncompose smoke: FAIL after %s s: %s\n(logs and summary in %s)\n' \
         "$((SECONDS - T0))" "${FAILED:-see above}" "$OUT" >&2 ;;
  esac
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

pick_engine

# -- 2. the compose files, checked by Debian's docker-compose -------------------------------

if ! have docker-compose && [ "$INSTALL" = 1 ] && have apt-get && [ "$(id -u)" = 0 ]; then
  apt_install docker-compose
fi
if have docker-compose; then
  for files in "compose.yaml" "compose.yaml compose.gpu.yaml"; do
    args=(); for f in $files; do args+=(-f "$f"); done
    env -u COMPOSE_PROJECT_NAME -u COMPOSE_FILE docker-compose "${args[@]}" config -q \
      > "$WORK/config.log" 2>&1 || fail "docker-compose config ($files): $(cat "$WORK/config.log")"
  done
  note "docker-compose config: compose.yaml, compose.yaml + compose.gpu.yaml valid ($(docker-compose version --short 2>/dev/null))"
else
  note "docker-compose config: skipped (no docker-compose)"
fi

# -- 3. images --------------------------------------------------------------------------------

BUILT_IMAGES=""
image_exists() { $ENGINE image inspect "$1" >/dev/null 2>&1; }
local_name() {  # podman keeps locally built images under localhost/
  if [ "$ENGINE" = podman ] && [[ "$1" != */* ]]; then echo "localhost/$1"; else echo "$1"; fi
}
debootstrap_base() {
  local base rootfs="$WORK/rootfs"
  base=$(local_name "$DEBOOTSTRAP_BASE")
  if image_exists "$base"; then
    log "base image: reusing $base (made by an earlier run with debootstrap)"
    echo "$base"; return
  fi
  have debootstrap || apt_install debootstrap
  log "base image: debootstrap bookworm (python3, python3-venv) into $rootfs"
  # NOTE: the host's extra CA certificates go in too: pip in the build must trust what the
  # host trusts (a TLS-inspecting proxy's CA, say).
  timeout 900 debootstrap --variant=minbase \
      --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
      bookworm "$rootfs" http://deb.debian.org/debian > "$WORK/debootstrap.log" 2>&1 \
    || fail "debootstrap failed: $(tail -3 "$WORK/debootstrap.log")"
  if compgen -G "/usr/local/share/ca-certificates/*.crt" > /dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
  fi
  chroot "$rootfs" update-ca-certificates > /dev/null 2>&1
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | $ENGINE import \
      --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
      --change 'CMD ["python3"]' - "$base" > "$WORK/import.log" 2>&1 \
    || fail "importing the debootstrap rootfs as $base failed: $(tail -2 "$WORK/import.log")"
  rm -rf "$rootfs"
  echo "$base"
}
pick_base() {
  if image_exists "$PYTHON_IMAGE" || timeout 120 $ENGINE pull -q "$PYTHON_IMAGE" > "$WORK/pull.log" 2>&1; then
    echo "$PYTHON_IMAGE"
  else
    log "cannot pull $PYTHON_IMAGE ($(tail -1 "$WORK/pull.log")); making one with debootstrap"
    debootstrap_base
  fi
}
BASE=$(pick_base)
note "base image: $BASE"
[ "$ENGINE" = podman ] && podman_conf "$BASE"

# a torch wheel that pip already has here (a local find-links directory, a wheel cache):
# pip download looks without touching an index, and LOCAL_WHEELS brings it into the build
LOCAL_WHEELS=${LOCAL_WHEELS:-deploy/wheels}
if ! compgen -G "$LOCAL_WHEELS/torch-*.whl" > /dev/null; then
  if "$PY" -m pip download --no-index --no-deps --only-binary=:all: --python-version 3.11 \
      --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 \
      "torch==$TORCH_VERSION" -d "$LOCAL_WHEELS" > "$WORK/wheel.log" 2>&1; then
    log "torch: staged a local wheel into $LOCAL_WHEELS"
  else
    log "torch: no local wheel for torch==$TORCH_VERSION; the build uses TORCH_INDEX_URL"
  fi
fi
note "torch: $(cd "$LOCAL_WHEELS" && ls torch-*.whl 2>/dev/null || echo "from ${TORCH_INDEX_URL:-the PyTorch CPU index}")"

IMAGE_REF=$(local_name "$IMAGE")
log "building $IMAGE (target cpu; log: $OUT/build.log)"
b0=$SECONDS
build_args=(--build-arg "PYTHON_IMAGE=$BASE" --build-arg "LOCAL_WHEELS=$LOCAL_WHEELS")
[ -n "${PIP_INDEX_URL:-}" ] && build_args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")
[ -n "${TORCH_INDEX_URL:-}" ] && build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
# podman: the docker image format, which keeps the Dockerfile's HEALTHCHECK (OCI drops it)
format_args=()
[ "$ENGINE" = podman ] && format_args=(--format docker)
build_args+=("${format_args[@]+"${format_args[@]}"}")
timeout "$BUILD_TIMEOUT_S" $ENGINE build --target cpu -t "$IMAGE" "${build_args[@]}" . \
    > "$OUT/build.log" 2>&1 || fail "building $IMAGE failed: $(tail -5 "$OUT/build.log")"
BUILT_IMAGES="$BUILT_IMAGES $IMAGE_REF"
size=$($ENGINE image inspect --format '{{.Size}}' "$IMAGE_REF")
note "image $IMAGE: $((size / 1000000)) MB, built in $((SECONDS - b0)) s"

PROMETHEUS_IMAGE=$OFFICIAL_PROMETHEUS
if ! image_exists "$OFFICIAL_PROMETHEUS" \
    && ! timeout 120 $ENGINE pull -q "$OFFICIAL_PROMETHEUS" > "$WORK/pull.log" 2>&1; then
  PROMETHEUS_IMAGE=$PROMETHEUS_STANDIN
  log "cannot pull $OFFICIAL_PROMETHEUS; building $PROMETHEUS_STANDIN from Debian's package"
  timeout "$BUILD_TIMEOUT_S" $ENGINE build -t "$PROMETHEUS_STANDIN" --build-arg "BASE_IMAGE=$BASE" \
      "${format_args[@]+"${format_args[@]}"}" \
      -f deploy/prometheus/Dockerfile.debian deploy/prometheus > "$OUT/build-prometheus.log" 2>&1 \
    || fail "building $PROMETHEUS_STANDIN failed: $(tail -5 "$OUT/build-prometheus.log")"
  BUILT_IMAGES="$BUILT_IMAGES $(local_name "$PROMETHEUS_STANDIN")"
fi
note "prometheus image: $PROMETHEUS_IMAGE ($($ENGINE run --rm --entrypoint /bin/sh "$PROMETHEUS_IMAGE" -c 'prometheus --version 2>&1 | head -1' 2>/dev/null || echo '?'))"

# -- 4. the stack -----------------------------------------------------------------------------

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export COMPOSE_PROJECT_NAME=$PROJECT CAROUSEL_IMAGE=$IMAGE PROMETHEUS_IMAGE CAROUSEL_BIND_ADDRESS=127.0.0.1
GATEWAY_PORT=$(free_port); PROMETHEUS_PORT=$(free_port); GRAFANA_PORT=$(free_port)
export GATEWAY_PORT PROMETHEUS_PORT GRAFANA_PORT
COMPOSE_FILES=(-p "$PROJECT" -f compose.yaml)
if [ -n "$BREAK" ] && [ "$BREAK" != arm-missing ]; then
  "$PY" "$CHECKS" break-override --mode "$BREAK" --work "$WORK" > "$WORK/break.yaml"
  COMPOSE_FILES+=(-f "$WORK/break.yaml")
  note "CAROUSEL_SMOKE_BREAK=$BREAK: $(head -1 "$WORK/break.yaml" | sed 's/^# //')"
fi
[ "$BREAK" = arm-missing ] && note "CAROUSEL_SMOKE_BREAK=arm-missing: no traffic to the static arm"

service_id() {
  $ENGINE ps -a -q --filter "label=com.docker.compose.project=$PROJECT" \
      --filter "label=com.docker.compose.service=$1" | head -1
}
up() {  # services...
  UP=1
  timeout 600 "${COMPOSE[@]}" "${COMPOSE_FILES[@]}" up -d --no-build --no-deps "$@" \
      > "$WORK/up.log" 2>&1 || fail "compose up $* failed: $(tail -5 "$WORK/up.log")"
}
# NOTE: podman runs healthchecks from systemd timers; where there is no systemd, nothing runs
# them, so this loop runs the container's own healthcheck (`podman healthcheck run`) itself.
wait_healthy() {  # services...: each healthy within HEALTH_TIMEOUT_S of this call
  local start=$SECONDS pending=("$@") svc id state health still
  while [ "${#pending[@]}" -gt 0 ]; do
    still=()
    for svc in "${pending[@]}"; do
      id=$(service_id "$svc")
      [ -n "$id" ] || fail "$svc: no container (compose up did not create it)"
      [ "$ENGINE" = podman ] && timeout 30 podman healthcheck run "$id" > /dev/null 2>&1 || true
      $ENGINE inspect "$id" > "$WORK/inspect.json" 2>/dev/null || echo '[{}]' > "$WORK/inspect.json"
      read -r state health < <("$PY" "$CHECKS" health-state "$WORK/inspect.json")
      case "$state:$health" in
        running:healthy)
          note "$svc: healthy $((SECONDS - start)) s after start" ;;
        running:unhealthy)
          fail "$svc did not become healthy: its healthcheck fails ($("$PY" "$CHECKS" health-rerun --engine "$ENGINE" "$WORK/inspect.json"))" ;;
        running:*) still+=("$svc") ;;
        *) fail "$svc is $state (not running) before it became healthy: $($ENGINE logs --tail 5 "$id" 2>&1 | tr '\n' ' ')" ;;
      esac
    done
    pending=("${still[@]+"${still[@]}"}")
    if [ "${#pending[@]}" -gt 0 ]; then
      if [ $((SECONDS - start)) -ge "$HEALTH_TIMEOUT_S" ]; then
        fail "${pending[*]} did not become healthy within $HEALTH_TIMEOUT_S s (health: $health; the check now: $("$PY" "$CHECKS" health-rerun --engine "$ENGINE" "$WORK/inspect.json"))"
      fi
      sleep 5
    fi
  done
}

# an engine's log, once it says how its CPU kernels went (ready, off or failed): healthy can
# come first
kernels_log() {  # $1: service; $2: where to write the log
  local start=$SECONDS
  while :; do
    $ENGINE logs "$(service_id "$1")" > "$2" 2>&1 || true
    grep -qE 'cpu_kernels_(ready|off|build_failed)' "$2" && return 0
    [ $((SECONDS - start)) -ge "$KERNELS_TIMEOUT_S" ] && return 0
    sleep 2
  done
}
log "starting engine-orca and engine-static (each converts the model into a fresh volume)"
up engine-orca engine-static
wait_healthy engine-orca engine-static
for svc in engine-orca engine-static; do  # the image's own CPU kernels, not torch's
  kernels_log "$svc" "$WORK/$svc-start.log"
  "$PY" "$CHECKS" kernels-ready --service "$svc" "$WORK/$svc-start.log" || fail "$svc does not run the CPU kernels built into the image"
done
log "starting the gateway on 127.0.0.1:$GATEWAY_PORT"
up gateway
wait_healthy gateway
log "starting prometheus on 127.0.0.1:$PROMETHEUS_PORT"
up prometheus
wait_healthy prometheus
note "stack healthy $((SECONDS - T0)) s after the script started"

# -- 5. the checks ----------------------------------------------------------------------------

GATEWAY=http://127.0.0.1:$GATEWAY_PORT
curl_metrics() {  # $1: service; the gateway from the host, each engine from inside its container
  if [ "$1" = gateway ]; then
    "$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$GATEWAY/metrics"
  else
    $ENGINE exec "$(service_id "$1")" python -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("http://127.0.0.1:8000/metrics", timeout=10).read().decode())'
  fi
}
traffic_args=(--gateway "$GATEWAY" --record "$WORK/traffic.json")
[ "$BREAK" = arm-missing ] && traffic_args+=(--skip-arm static)
curl_metrics gateway > "$WORK/metrics-gateway-before.txt" || fail "scraping the gateway's /metrics failed"
check() {  # the python checks print one line per check: to the console and the summary
  if ! "$PY" "$CHECKS" "$@" 2> "$WORK/check.err" | tee -a "$SUMMARY" >&2; then
    cat "$WORK/check.err" >&2
    fail "$(sed -n 's/^FAIL: //p' "$WORK/check.err" | tail -1)"
  fi
}
check traffic "${traffic_args[@]}"
for svc in gateway engine-orca engine-static; do
  curl_metrics "$svc" > "$WORK/metrics-$svc.txt" || fail "scraping $svc's /metrics failed"
  cp "$WORK/metrics-$svc.txt" "$OUT/metrics-$svc.txt"
done
check metrics --record "$WORK/traffic.json" --scrape "gateway=$WORK/metrics-gateway.txt" \
    --baseline "$WORK/metrics-gateway-before.txt"
check prometheus --url "http://127.0.0.1:$PROMETHEUS_PORT" --record "$WORK/traffic.json" \
    --timeout "$CHECK_TIMEOUT_S"
# NOTE: each panel's query is polled until it has its series (a rate() needs two scrapes in
# its window), then fails with what it lacks after CHECK_TIMEOUT_S
check dashboard --prometheus "http://127.0.0.1:$PROMETHEUS_PORT" --timeout "$CHECK_TIMEOUT_S" \
    --scrape "gateway=$WORK/metrics-gateway.txt" --scrape "engine-orca=$WORK/metrics-engine-orca.txt" \
    --scrape "engine-static=$WORK/metrics-engine-static.txt"
note "all checks passed; $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -m), $(nproc) CPUs"
exit 0
}
