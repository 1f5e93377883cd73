#!/usr/bin/env bash
# Start a single-node Slurm (slurmctld + slurmd + munge) on localhost, all state under one folder.
#
#   scripts/slurm-up.sh [DIR]        (default DIR: ${SCFOUNDRY_SLURM_DIR:-/tmp/scfoundry-slurm})
#   export SLURM_CONF=DIR/etc/slurm.conf SCFOUNDRY_TEST_SLURM_CONF=DIR/etc/slurm.conf
#   scripts/slurm-down.sh [DIR]
#
# Needs root and Debian's packages (installs nothing itself):
#   apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
# The node declares two fake GPUs (placeholder character devices made with mknod) so that
# `sbatch --gpus=1` is accepted and sets CUDA_VISIBLE_DEVICES. Facts behind each setting:
# shared/SLURM.md.
set -euo pipefail
trap 'echo "slurm-up: failed at line $LINENO (logs in ${DIR:-?}/log)" >&2' ERR

DIR=${1:-${SCFOUNDRY_SLURM_DIR:-/tmp/scfoundry-slurm}}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

for tool in slurmctld slurmd sbatch squeue scontrol munged mungekey munge unmunge; do
    command -v "$tool" >/dev/null || { echo "slurm-up: $tool not found; install: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "slurm-up: run as root (slurmd and munged need it)" >&2; exit 1; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if alive "$DIR/run/slurmctld.pid" && alive "$DIR/run/slurmd.pid"; then
    echo "slurm-up: already running in $DIR (scripts/slurm-down.sh $DIR stops it)" >&2
    echo "export SLURM_CONF=$DIR/etc/slurm.conf SCFOUNDRY_TEST_SLURM_CONF=$DIR/etc/slurm.conf"
    exit 0
fi
for port in "${SCFOUNDRY_SLURMCTLD_PORT:-6817}" "${SCFOUNDRY_SLURMD_PORT:-6818}"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "slurm-up: port $port is in use (another Slurm?); stop it or set SCFOUNDRY_SLURMCTLD_PORT / SCFOUNDRY_SLURMD_PORT" >&2
        exit 1
    fi
done
# a half-started cluster is stopped first
"$(dirname "$0")/slurm-down.sh" "$DIR" 2>/dev/null || true

mkdir -p "$DIR"/{etc,log,run,spool/ctld,spool/d,munge/key,munge/sock,munge/log,dev}
runuser -u munge -- test -x "$DIR" || { echo "slurm-up: the munge user cannot reach $DIR; choose a folder outside /root, e.g. /tmp/scfoundry-slurm" >&2; exit 1; }
# munge: the key folder private to munge, the socket folder world-readable (munge clients
# fail with "Socket is inaccessible" otherwise)
chown -R munge:munge "$DIR/munge"
chmod 0700 "$DIR/munge/key" "$DIR/munge/log"
chmod 0755 "$DIR/munge" "$DIR/munge/sock"
[ -f "$DIR/munge/key/munge.key" ] || runuser -u munge -- mungekey --create --keyfile="$DIR/munge/key/munge.key"
runuser -u munge -- munged \
    --key-file="$DIR/munge/key/munge.key" \
    --socket="$DIR/munge/sock/munge.socket.2" \
    --pid-file="$DIR/munge/sock/munged.pid" \
    --log-file="$DIR/munge/log/munged.log" \
    --seed-file="$DIR/munge/key/munged.seed"
export MUNGE_SOCKET="$DIR/munge/sock/munge.socket.2"
munge -n --socket="$MUNGE_SOCKET" | unmunge --socket="$MUNGE_SOCKET" >/dev/null || { echo "slurm-up: munge does not work; see $DIR/munge/log/munged.log" >&2; exit 1; }

# two placeholder GPU devices (gres.conf needs File= entries, or the node goes INVAL)
for i in 0 1; do [ -e "$DIR/dev/gpu$i" ] || mknod "$DIR/dev/gpu$i" c 1 3; done

CPUS=$(nproc)
MEM=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
MEM=$(( MEM > 1024 ? MEM - 512 : MEM ))

cat > "$DIR/etc/slurm.conf" <<CONF
# single-node Slurm for scfoundry's tests, written by scripts/slurm-up.sh
ClusterName=scfoundry
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/sock/munge.socket.2
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${SCFOUNDRY_SLURMCTLD_PORT:-6817}
SlurmdPort=${SCFOUNDRY_SLURMD_PORT:-6818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerParameters=sched_interval=1
MinJobAge=600
DefMemPerCPU=512
ReturnToService=2
MpiDefault=none
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
cat > "$DIR/etc/gres.conf" <<CONF
NodeName=localhost Name=gpu File=$DIR/dev/gpu0
NodeName=localhost Name=gpu File=$DIR/dev/gpu1
CONF
rm -f "$DIR/etc/cgroup.conf"

export SLURM_CONF="$DIR/etc/slurm.conf"
slurmctld -i -f "$SLURM_CONF"
slurmd -N localhost -f "$SLURM_CONF"

# wait for the node, then run a warm-up job (the first job waits for the first scheduling pass)
for _ in $(seq 1 60); do
    state=$(sinfo -h -N -o %t 2>/dev/null | head -1 || true)
    [ "$state" = idle ] && break
    sleep 0.5
done
[ "$state" = idle ] || { echo "slurm-up: node is '${state:-unknown}', not idle; see $DIR/log/" >&2; sinfo -N -l >&2 || true; exit 1; }
start=$(date +%s.%N)
job=$(sbatch --parsable --output=/dev/null --wrap=true)
for _ in $(seq 1 120); do
    squeue -h -j "$job" 2>/dev/null | grep -q . || break
    sleep 0.25
done
end=$(date +%s.%N)
echo "slurm-up: Slurm is up in $DIR (warm-up job $job took $(printf '%.1f' "$(echo "$end - $start" | bc 2>/dev/null || echo 0)")s)" >&2
echo "export SLURM_CONF=$SLURM_CONF SCFOUNDRY_TEST_SLURM_CONF=$SLURM_CONF"
