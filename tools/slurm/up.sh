#!/usr/bin/env bash
# tools/slurm/up.sh: bring up a throw-away Slurm 22.05 cluster on this host (Debian 12, no systemd,
# no cgroups) for tests/slurm. Started by tests/slurm/conftest.py when no Slurm answers.
# munged, slurmctld, N x slurmd (logical nodes <prefix>0..N-1 on 127.0.0.1), and optionally
# MariaDB + slurmdbd so that sacct works. Everything lives under $SLURM_CI_DIR.
# Idempotent: daemons that are already running (by PID file) are left alone; a changed config
# restarts the Slurm daemons. Works as root, or as a normal user if the packages are already installed
# (then only that user can run jobs).
# Afterwards:  source "$SLURM_CI_DIR/env.sh"   (exports SLURM_CONF)
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin

DIR=${SLURM_CI_DIR:-/tmp/relax-slurm-ci}
NODES=${SLURM_CI_NODES:-3}            # logical nodes; a het job needs one idle node per component
                                      # (3: a 2-node trainer group + 1 rollout node fits)
CPUS=${SLURM_CI_CPUS:-32}             # CPUs advertised per logical node (may exceed the hardware; the
                                      # ready scripts in sbatch/ ask for 32)
MEM=${SLURM_CI_MEM_MB:-4000}          # RealMemory per node (not enforced; CR_Core)
GPUS=${SLURM_CI_GPUS:-8}              # GPUs advertised per node: count-only gres, no devices behind
                                      # them, so that GPU sbatch scripts (sbatch/*.sbatch) schedule here
PREFIX=${SLURM_CI_NODE_PREFIX:-ci}
BASE=${SLURM_CI_PORT_BASE:-6817}      # slurmctld=BASE, slurmdbd=BASE+1, MariaDB=BASE+2, slurmd i=BASE+10+i
DBD=${SLURM_CI_DBD:-1}                # 1: MariaDB + slurmdbd (real sacct); 0: no accounting
PROCTRACK=${SLURM_CI_PROCTRACK:-linuxproc} # or pgid: also kills orphaned job processes, but +3 s per job end here
INSTALL=${SLURM_CI_INSTALL:-1}        # root only: apt-get install what is missing
SMOKE=${SLURM_CI_SMOKE:-1}            # run one trivial job at the end
CLUSTER=${SLURM_CI_CLUSTER:-ci}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ME=$(id -un)
HOST=$(hostname -s)
IS_ROOT=0; [ "$(id -u)" = 0 ] && IS_ROOT=1
ETC_HOSTS=${SLURM_CI_ETC_HOSTS:-$IS_ROOT}  # 1: add "127.0.0.1 <nodes>" to /etc/hosts so node names resolve
CONF=$DIR/etc/slurm.conf
MUNGE_SOCK=$DIR/run/munge/munge.sock
CTLD_PORT=$BASE; DBD_PORT=$((BASE + 1)); DB_PORT=$((BASE + 2))
NODELIST="${PREFIX}[0-$((NODES - 1))]"; [ "$NODES" = 1 ] && NODELIST="${PREFIX}0"
export SLURM_CONF=$CONF

# shellcheck source=common.sh
. "$HERE/common.sh"   # log, alive, stop_pidfile
die() { echo "[slurm-ci] ERROR: $*" >&2; for f in "$DIR"/log/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }; done; exit 1; }

wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
  local t=$1 what=$2; shift 2
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do [ $SECONDS -ge $end ] && die "timed out waiting for $what"; sleep 0.2; done
}
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# 1. packages ------------------------------------------------------------------------------------
need=()
# slurm-wlm: slurmctld + slurmd + slurm-client (sbatch, srun, squeue, scontrol, sacct)
for b in slurmctld slurmd sbatch munged mungekey; do command -v "$b" >/dev/null || need+=(slurm-wlm munge); done
if [ "$DBD" = 1 ]; then
  for b in slurmdbd mariadbd mariadb-install-db mariadb; do command -v "$b" >/dev/null || need+=(slurmdbd mariadb-server-core mariadb-client-core); done
fi
if [ ${#need[@]} -gt 0 ]; then
  pkgs=$(printf '%s\n' "${need[@]}" | sort -u | tr '\n' ' ')
  [ "$IS_ROOT" = 1 ] && [ "$INSTALL" = 1 ] || die "missing packages: ${pkgs}(install them as root: apt-get install $pkgs)"
  command -v apt-get >/dev/null || die "missing packages: $pkgs(and no apt-get to install them)"
  log "apt-get update && apt-get install $pkgs(a few minutes)"
  export DEBIAN_FRONTEND=noninteractive
  # Package scripts would start the system's own munged/slurmd/slurmctld through invoke-rc.d;
  # a policy-rc.d answering 101 ("action forbidden") keeps them stopped while we install.
  policy=/usr/sbin/policy-rc.d; own_policy=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod 755 "$policy"; own_policy=1; fi
  mkdir -p "$DIR/log"; rc=0
  { apt-get update -q && apt-get install -y -q --no-install-recommends $pkgs; } > "$DIR/log/apt.log" 2>&1 || rc=$?
  [ "$own_policy" = 1 ] && rm -f "$policy"
  [ "$rc" = 0 ] || die "apt-get install $pkgs failed (log: $DIR/log/apt.log)"
  for b in slurmctld slurmd sbatch munged; do command -v "$b" >/dev/null || die "$b still missing after apt-get install"; done
fi

# 2. directories, munge key, configs -------------------------------------------------------------
mkdir -p "$DIR"/{etc,log,run/munge,state/ctld,state/munge,db}
for i in $(seq 0 $((NODES - 1))); do mkdir -p "$DIR/state/spool/$PREFIX$i"; done
touch "$DIR/.slurm-ci"                       # marker: down.sh --purge only deletes marked dirs
chmod 755 "$DIR" "$DIR/run" "$DIR/run/munge" # munged: socket dir must be world-executable
chmod 700 "$DIR/state/munge"                 # munged: key dir must not be group/world writable
if [ ! -s "$DIR/state/munge/munge.key" ]; then
  mungekey --create --keyfile="$DIR/state/munge/munge.key" 2>/dev/null ||
    dd if=/dev/urandom of="$DIR/state/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$DIR/state/munge/munge.key"
fi

# fake GPUs: slurmd drops file-less GPUs and wants character devices, so each is a copy of
# /dev/null's device node (mknod needs root; without it the nodes get no GPUs)
if [ "$GPUS" -gt 0 ]; then
  mkdir -p "$DIR/dev"
  for i in $(seq 0 $((GPUS - 1))); do
    [ -c "$DIR/dev/gpu$i" ] || mknod "$DIR/dev/gpu$i" c 1 3 2>/dev/null || { log "mknod failed: no fake GPUs"; GPUS=0; break; }
  done
fi
gres_txt=""; [ "$GPUS" -gt 0 ] && gres_txt=" Gres=gpu:$GPUS"
nodes_txt=$(for i in $(seq 0 $((NODES - 1))); do
  echo "NodeName=$PREFIX$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((BASE + 10 + i)) CPUs=$CPUS RealMemory=$MEM$gres_txt State=UNKNOWN"
done)
if [ "$DBD" = 1 ]; then
  acct_txt="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# slurmctld/sacct reach slurmdbd through this munged socket (AuthInfo is not used for that link)
AccountingStoragePass=$MUNGE_SOCK"
else
  acct_txt="AccountingStorageType=accounting_storage/none"
fi
render() { # render TEMPLATE > output
  local line
  while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in
      @NODES@) echo "$nodes_txt" ;;
      @ACCOUNTING@) echo "$acct_txt" ;;
      @GRES@) [ "$GPUS" -gt 0 ] && echo "GresTypes=gpu" ;;
      *) line=${line//@CLUSTER@/$CLUSTER}; line=${line//@HOST@/$HOST}; line=${line//@USER@/$ME}
         line=${line//@CTLD_PORT@/$CTLD_PORT}; line=${line//@DBD_PORT@/$DBD_PORT}; line=${line//@DB_PORT@/$DB_PORT}
         line=${line//@DIR@/$DIR}; line=${line//@PROCTRACK@/$PROCTRACK}; echo "$line" ;;
    esac
  done < "$1"
}
changed=0
if [ "$GPUS" -gt 0 ]; then printf 'AutoDetect=off\nName=gpu File=%s/dev/gpu[0-%s]\n' "$DIR" $((GPUS - 1)); fi > "$DIR/etc/gres.conf.new"
cmp -s "$DIR/etc/gres.conf.new" "$DIR/etc/gres.conf" 2>/dev/null || changed=1
mv "$DIR/etc/gres.conf.new" "$DIR/etc/gres.conf"
render "$HERE/slurm.conf.in" > "$CONF.new"
cmp -s "$CONF.new" "$CONF" 2>/dev/null || changed=1
mv "$CONF.new" "$CONF"
if [ "$DBD" = 1 ]; then
  render "$HERE/slurmdbd.conf.in" > "$DIR/etc/slurmdbd.conf.new"
  cmp -s "$DIR/etc/slurmdbd.conf.new" "$DIR/etc/slurmdbd.conf" 2>/dev/null || changed=1
  mv "$DIR/etc/slurmdbd.conf.new" "$DIR/etc/slurmdbd.conf"
  chmod 600 "$DIR/etc/slurmdbd.conf"     # slurmdbd refuses a readable config
fi
cat > "$DIR/env.sh" <<EOF
export SLURM_CONF=$CONF
EOF

if [ "$ETC_HOSTS" = 1 ] && [ -w /etc/hosts ]; then
  mark="# slurm-ci:$DIR"
  want="127.0.0.1 $(for i in $(seq 0 $((NODES - 1))); do printf '%s ' "$PREFIX$i"; done)$mark"
  if ! grep -qxF -- "$want" /etc/hosts; then
    # rewrite in place (/etc/hosts is often a bind mount: no sed -i / rename)
    { grep -vF -- "$mark" /etc/hosts || true; echo "$want"; } > "$DIR/run/hosts.tmp"
    cat "$DIR/run/hosts.tmp" > /etc/hosts; rm -f "$DIR/run/hosts.tmp"
  fi
fi

# 3. daemons -------------------------------------------------------------------------------------
if [ "$changed" = 1 ]; then   # config changed: restart the Slurm daemons (state is kept)
  for pf in "$DIR"/run/slurmd-*.pid; do [ -e "$pf" ] && stop_pidfile "$pf" "$CONF" "$(basename "$pf" .pid)" & done; wait
  stop_pidfile "$DIR/run/slurmctld.pid" "$CONF" slurmctld &
  stop_pidfile "$DIR/run/slurmdbd.pid" "SLURM_CONF=$CONF" slurmdbd &
  wait
fi

if ! alive "$DIR/run/munged.pid" "$MUNGE_SOCK"; then
  log "starting munged"
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  munged --key-file="$DIR/state/munge/munge.key" --socket="$MUNGE_SOCK" --pid-file="$DIR/run/munged.pid" \
         --log-file="$DIR/log/munged.log" --seed-file="$DIR/state/munge/munged.seed"
fi
munge_ok() { munge -n -S "$MUNGE_SOCK" | unmunge -S "$MUNGE_SOCK"; }
wait_for 20 munged munge_ok

if [ "$DBD" = 1 ]; then
  if ! alive "$DIR/run/mariadb.pid" "--datadir=$DIR/db"; then
    if [ ! -d "$DIR/db/mysql" ]; then
      log "initialising MariaDB in $DIR/db"
      mariadb-install-db --no-defaults --user="$ME" --datadir="$DIR/db" \
        --auth-root-authentication-method=socket --skip-test-db --skip-name-resolve > "$DIR/log/mariadb-install.log" 2>&1 ||
        die "mariadb-install-db failed"
    fi
    port_busy "$DB_PORT" && die "port $DB_PORT (MariaDB) is already in use"
    log "starting mariadbd on 127.0.0.1:$DB_PORT"
    setsid -f mariadbd --no-defaults $([ "$IS_ROOT" = 1 ] && echo --user=root) --datadir="$DIR/db" \
      --socket="$DIR/run/mariadb.sock" --pid-file="$DIR/run/mariadb.pid" --bind-address=127.0.0.1 --port="$DB_PORT" \
      --skip-name-resolve --innodb-buffer-pool-size=64M --innodb-use-native-aio=0 \
      --log-error="$DIR/log/mariadb.log" < /dev/null > /dev/null 2>&1
  fi
  db() { mariadb --no-defaults -S "$DIR/run/mariadb.sock" -u"$ME" "$@"; }   # unix_socket auth as $ME
  wait_for 60 MariaDB db -e 'select 1'
  db -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmci';
         GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
  if ! alive "$DIR/run/slurmdbd.pid" "SLURM_CONF=$CONF"; then
    port_busy "$DBD_PORT" && die "port $DBD_PORT (slurmdbd) is already in use"
    log "starting slurmdbd on 127.0.0.1:$DBD_PORT"
    slurmdbd      # finds slurmdbd.conf next to $SLURM_CONF; daemonizes
  fi
  wait_for 60 slurmdbd port_busy "$DBD_PORT"
fi

if ! alive "$DIR/run/slurmctld.pid" "$CONF"; then
  port_busy "$CTLD_PORT" && die "port $CTLD_PORT (slurmctld) is already in use"
  log "starting slurmctld on 127.0.0.1:$CTLD_PORT"
  slurmctld -f "$CONF"
fi
ctld_up() { [[ $(scontrol ping 2>/dev/null) == *"is UP"* ]]; }
wait_for 60 slurmctld ctld_up

started_slurmd=0
for i in $(seq 0 $((NODES - 1))); do
  n=$PREFIX$i
  if ! alive "$DIR/run/slurmd-$n.pid" "$CONF"; then
    started_slurmd=$((started_slurmd + 1))
    port_busy $((BASE + 10 + i)) && die "port $((BASE + 10 + i)) (slurmd $n) is already in use"
    log "starting slurmd $n on port $((BASE + 10 + i))"
    slurmd -f "$CONF" -N "$n"
  fi
done
nodes_up() { [ "$(sinfo -h -N -n "$NODELIST" -o '%N %T' | grep -cE ' (idle|mixed|allocated|completing)$')" -ge "$NODES" ]; }
end=$((SECONDS + 60))
until nodes_up; do
  # nodes left down/drained by an earlier run: resume them once
  [ -z "${resumed:-}" ] && [ $((end - SECONDS)) -lt 50 ] && { scontrol update nodename="$NODELIST" state=resume 2>/dev/null || true; resumed=1; }
  [ $SECONDS -ge $end ] && { sinfo -N -l >&2; die "nodes did not come up"; }
  sleep 0.2
done
# Every slurmd was (re)started just now, so no job process of this cluster can be alive: jobs
# that slurmctld recovered from its saved state (the machine or the daemons were killed without
# down.sh) are ghosts that would hold the nodes for hours, or pending runs of a past session.
if [ "$started_slurmd" = "$NODES" ]; then
  ghosts=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
  if [ -n "${ghosts// /}" ]; then
    log "cancelling jobs left from an earlier life of this cluster: $ghosts"
    scancel $ghosts 2>/dev/null || true
    for _ in $(seq 1 150); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi
log "cluster up: $(sinfo -h -o '%P %a %D %T %N' | tr '\n' ' ')"

# 4. smoke test ----------------------------------------------------------------------------------
if [ "$SMOKE" = 1 ]; then
  t0=$(date +%s.%N)
  jid=$(cd "$DIR/run" && sbatch --parsable -o /dev/null -J smoke --wrap 'srun true') || die "sbatch failed"
  end=$((SECONDS + 60))
  while [ -n "$(squeue -h -j "$jid" 2>/dev/null)" ]; do [ $SECONDS -ge $end ] && die "smoke job $jid did not finish"; sleep 0.1; done
  st=$(scontrol show job "$jid" | grep -o 'JobState=[A-Z]*')
  [ "$st" = JobState=COMPLETED ] || die "smoke job $jid: $st"
  log "smoke job $jid COMPLETED in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b-a}') s"
fi
log "use it with:  source $DIR/env.sh   (SLURM_CONF=$CONF)"
