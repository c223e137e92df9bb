#!/usr/bin/env bash
# tools/slurm/down.sh: stop the cluster started by tools/slurm/up.sh. Cancels its jobs, then stops only the daemons named
# in its PID files (checking each PID still belongs to this cluster). --purge also deletes $SLURM_CI_DIR.
set -uo pipefail
export PATH=$PATH:/usr/sbin:/sbin
DIR=${SLURM_CI_DIR:-/tmp/relax-slurm-ci}
CONF=$DIR/etc/slurm.conf
export SLURM_CONF=$CONF
PURGE=0; [ "${1:-}" = --purge ] && PURGE=1
# shellcheck source=common.sh
. "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"   # log, alive, stop_pidfile
[ -d "$DIR" ] || { log "nothing to do ($DIR does not exist)"; exit 0; }

# 1. cancel every job of this cluster while slurmctld/slurmd can still clean up their processes
if alive "$DIR/run/slurmctld.pid" "$CONF"; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs: $jobs"
    scancel $jobs 2>/dev/null
    for _ in $(seq 1 150); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

# 2. daemons, in reverse start order
for pf in "$DIR"/run/slurmd-*.pid; do [ -e "$pf" ] && stop_pidfile "$pf" "$CONF" "$(basename "$pf" .pid)" & done; wait
stop_pidfile "$DIR/run/slurmctld.pid" "$CONF" slurmctld &
stop_pidfile "$DIR/run/slurmdbd.pid" "SLURM_CONF=$CONF" slurmdbd &
wait
stop_pidfile "$DIR/run/mariadb.pid" "--datadir=$DIR/db" mariadbd
stop_pidfile "$DIR/run/munged.pid" "$DIR/run/munge/munge.sock" munged

# 3. /etc/hosts line added by up.sh (rewritten in place: it may be a bind mount)
mark="# slurm-ci:$DIR"
if [ -w /etc/hosts ] && grep -qF -- "$mark" /etc/hosts; then
  grep -vF -- "$mark" /etc/hosts > "$DIR/hosts.tmp"; cat "$DIR/hosts.tmp" > /etc/hosts; rm -f "$DIR/hosts.tmp"
  log "removed node names from /etc/hosts"
fi

if [ "$PURGE" = 1 ]; then
  if [ -f "$DIR/.slurm-ci" ]; then rm -rf -- "$DIR"; log "deleted $DIR"; else log "not deleting $DIR: no .slurm-ci marker"; fi
fi
log "down"
