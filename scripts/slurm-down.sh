#!/usr/bin/env bash
# Stop the single-node Slurm that scripts/slurm-up.sh started in DIR: each daemon by its pid
# file (SIGTERM, then up to 15 s). Job state stays in DIR until it is removed.
#   scripts/slurm-down.sh [DIR] [--purge]
set -uo pipefail
DIR=${1:-${SCFOUNDRY_SLURM_DIR:-/tmp/scfoundry-slurm}}
stop() {
    local pidfile=$1 name=$2
    [ -f "$pidfile" ] || return 0
    local pid
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "slurm-down: $name ($pid) did not stop in 15 s; sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null
        fi
    fi
    rm -f "$pidfile"
}
stop "$DIR/run/slurmd.pid" slurmd
stop "$DIR/run/slurmctld.pid" slurmctld
stop "$DIR/munge/sock/munged.pid" munged
if [ "${2:-}" = --purge ]; then
    rm -rf "$DIR"
fi
echo "slurm-down: stopped Slurm in $DIR" >&2
