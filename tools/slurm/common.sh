# tools/slurm/common.sh: helpers shared by up.sh and down.sh (sourced, not run).
# Needs $DIR (the cluster's directory) set by the caller.

log() { echo "[slurm-ci $(date +%T)] $*"; }

# alive PIDFILE PATTERN: the PID in PIDFILE runs and its cmdline or environment mentions PATTERN
# (so that a PID reused by an unrelated process is never taken for one of our daemons)
alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  local s; s=$({ tr '\0' '\n' < "/proc/$pid/cmdline"; tr '\0' '\n' < "/proc/$pid/environ"; } 2>/dev/null)
  [[ $s == *"$2"* ]]   # (no grep -q in a pipe: with pipefail, SIGPIPE would make this fail)
}

# stop_pidfile PIDFILE PATTERN NAME: SIGTERM the daemon if alive() says it is ours, wait up to
# 20 s, then SIGKILL; the PID file is removed either way. Never fails (safe under set -e).
stop_pidfile() {
  alive "$1" "$2" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1"); log "stopping $3 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then log "$3 still running, SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$1"
  return 0
}
