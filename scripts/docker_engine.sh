#!/usr/bin/env bash
# Makes a local Docker engine available for the cluster tests, or stops the one it started.
#
#   bash scripts/docker_engine.sh [start]   # install docker.io + docker-compose if missing, start dockerd, wait
#   bash scripts/docker_engine.sh stop      # stop the dockerd this script started (never another one)
#   bash scripts/docker_engine.sh status    # exit 0 when `docker info` answers
#
# dockerd runs with the vfs storage driver and without iptables (both work inside a VM or
# container without overlayfs or netfilter rights), without the default docker0 bridge
# (it would take 172.17.0.0/16), and with its address pool inside 198.18.0.0/15, so no
# network it creates ever lands in a private range. Exits non-zero, with the reason on
# stderr, when no engine can be made to answer within the time limits below.
#
# Environment: OMNIREDUCE_DOCKERD_LOG (default /var/log/omnireduce-dockerd.log),
# OMNIREDUCE_DOCKER_WAIT (seconds to wait for the engine, default 60),
# OMNIREDUCE_APT_TIMEOUT (seconds for apt-get update + install, default 300).
set -euo pipefail

MODE=${1:-start}
LOG=${OMNIREDUCE_DOCKERD_LOG:-/var/log/omnireduce-dockerd.log}
WAIT=${OMNIREDUCE_DOCKER_WAIT:-60}
APT_TIMEOUT=${OMNIREDUCE_APT_TIMEOUT:-300}
# Our own pid file, so `stop` only ever stops the daemon this script started.
PIDFILE=/run/omnireduce-dockerd.pid
POOL=198.19.0.0/16

say() { echo "docker_engine: $*" >&2; }

engine_up() { timeout 10 docker info >/dev/null 2>&1; }

compose_cmd() {
    if timeout 10 docker compose version >/dev/null 2>&1; then
        echo "docker compose"
    elif command -v docker-compose >/dev/null 2>&1; then
        echo "docker-compose"
    fi
}

install_packages() {
    local want=()
    command -v dockerd >/dev/null 2>&1 || want+=(docker.io)
    [ -n "$(compose_cmd)" ] || want+=(docker-compose)
    [ ${#want[@]} -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ]; then
        say "need root to install ${want[*]}"
        return 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        say "no apt-get: install ${want[*]} by hand"
        return 1
    fi
    say "installing ${want[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    timeout "$APT_TIMEOUT" apt-get update -qq >&2 || { say "apt-get update failed"; return 1; }
    timeout "$APT_TIMEOUT" apt-get install -y -qq --no-install-recommends "${want[@]}" >&2 \
        || { say "apt-get install ${want[*]} failed"; return 1; }
}

start() {
    if engine_up; then
        say "engine already answering; compose: $(compose_cmd || true)"
        return 0
    fi
    install_packages
    command -v docker >/dev/null 2>&1 || { say "no docker client after install"; return 1; }
    if [ "$(id -u)" != 0 ]; then
        say "no engine answers and starting dockerd needs root"
        return 1
    fi
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
        say "dockerd $(cat "$PIDFILE") (ours) is running but does not answer yet"
    elif pgrep -x dockerd >/dev/null 2>&1; then
        say "a dockerd not started by this script is running but does not answer; not starting another"
        return 1
    else
        mkdir -p "$(dirname "$LOG")"
        say "starting dockerd (log: $LOG)"
        # setsid: the daemon must outlive this script and the caller's process group.
        setsid dockerd --storage-driver=vfs --iptables=false --ip-masq=false --bridge=none \
            --default-address-pool "base=$POOL,size=24" >"$LOG" 2>&1 </dev/null &
        echo $! >"$PIDFILE"
    fi
    local deadline=$((SECONDS + WAIT))
    while ! engine_up; do
        if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
            say "dockerd exited; last lines of $LOG:"
            tail -n 20 "$LOG" >&2 || true
            rm -f "$PIDFILE"
            return 1
        fi
        if [ $SECONDS -ge $deadline ]; then
            say "dockerd did not answer within ${WAIT}s; last lines of $LOG:"
            tail -n 20 "$LOG" >&2 || true
            return 1
        fi
        sleep 0.5
    done
    say "engine up: server $(docker version --format '{{.Server.Version}}' 2>/dev/null); compose: $(compose_cmd || echo none)"
}

stop() {
    if [ ! -f "$PIDFILE" ]; then
        say "no dockerd started by this script"
        return 0
    fi
    local pid
    pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 1 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$pid" 2>/dev/null; then
            say "dockerd $pid ignored SIGTERM for 30 s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$PIDFILE"
    say "stopped dockerd $pid"
}

case "$MODE" in
    start) start ;;
    stop) stop ;;
    status) engine_up ;;
    *) say "usage: $0 [start|stop|status]"; exit 2 ;;
esac
