#!/usr/bin/env bash
# Stop what tools/slurm_up.sh started, by PID file only (never by process name).
# Order: cancel jobs -> slurmd(s) + slurmctld -> slurmdbd -> mariadbd -> munged.
# --purge also deletes Slurm state (job ids restart at 1), the accounting DB and logs.
set -uo pipefail
log() { echo "[slurm_down] $*" >&2; }
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop() {  # stop <timeout_s> <pidfile>...
  local t=$1; shift; local pids=() p
  for p in "$@"; do [[ -e $p ]] && alive "$p" && pids+=("$(cat "$p")"); done
  if (( ${#pids[@]} )); then
    log "TERM ${pids[*]} ($*)"
    kill -TERM "${pids[@]}" 2>/dev/null
    for _ in $(seq $((t * 5))); do
      local left=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
      [[ $left == 0 ]] && break; sleep 0.2
    done
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && { log "KILL $p"; kill -KILL "$p"; }; done
  fi
  for p in "$@"; do [[ -e $p ]] && rm -f "$p"; done
  return 0
}

if alive /run/slurmctld.pid; then   # cancel jobs first so no slurmstepd outlives its slurmd
  timeout 10 scancel --quiet --user="$(id -un)" 2>/dev/null || true
  for _ in $(seq 50); do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 0.2; done
fi
shopt -s nullglob
stop 15 /run/slurmd-*.pid /run/slurmctld.pid
stop 15 /run/slurmdbd.pid
if [[ ${1:-} == --purge ]] && alive /run/mysqld/mysqld.pid; then
  mariadb -e "DROP DATABASE IF EXISTS slurm_acct_db" 2>/dev/null || true
fi
stop 30 /run/mysqld/mysqld.pid
if alive /run/munge/munged.pid; then
  log "stopping munged"
  munged --stop >/dev/null 2>&1 || stop 5 /run/munge/munged.pid
fi

if [[ ${1:-} == --purge ]]; then
  log "purging slurm state and logs (accounting DB dropped above)"
  rm -rf /var/lib/slurm/slurmctld/* /var/lib/slurm/slurmd/* /var/log/slurm/*
fi
log "done"
