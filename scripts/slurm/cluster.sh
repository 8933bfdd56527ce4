#!/usr/bin/env bash
# A one-host SLURM cluster to try train.sbatch on and to test against: slurmctld and two slurmd
# nodes (runkit-node1, runkit-node2, one CPU each) on this machine, no systemd. Run as root.
#   sudo scripts/slurm/cluster.sh start    # installs slurm-wlm and munge when missing (apt-get)
#   export SLURM_CONF=/tmp/runkit-slurm/slurm.conf
#   sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 --cpus-per-task=1 \
#       scripts/slurm/train.sbatch trainer.accelerator=cpu
#   sudo scripts/slurm/cluster.sh reset    # forget every job: job ids start again at 1
#   sudo scripts/slurm/cluster.sh stop     # stops the daemons, takes its /etc/hosts line back
# Starts and stops pair up: a stop leaves the cluster running while an earlier start still holds it.
# Its files (config, logs, state, finished jobs in jobcomp.txt) are in $RUNKIT_SLURM_DIR
# (/tmp/runkit-slurm). A requeued job waits cred_expire + 1 s (11 s here) before it runs again.
set -euo pipefail
DIR="${RUNKIT_SLURM_DIR:-/tmp/runkit-slurm}"
NODES=(runkit-node1 runkit-node2)
HOSTS_LINE="127.0.0.1 ${NODES[*]} # runkit-slurm"
export SLURM_CONF="$DIR/slurm.conf"

fail() { echo "error: $*" >&2; exit 1; }
alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop_pid() {  # stop the daemon whose pid file is $1, waiting until it has gone
    alive "$1" || return 0
    local pid; pid="$(cat "$1")"
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
}
wait_for() {  # wait_for <what> <command...>: up to 60 s
    local what="$1"; shift
    for _ in $(seq 300); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    fail "$what did not come up within 60 s; see the logs in $DIR"
}

install() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null && return 0
    echo "cluster: installing slurm-wlm and munge (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_config() {
    mkdir -p "$DIR/ctld" "$DIR/jobs"
    local host; host="$(hostname -s)"
    cat >"$SLURM_CONF" <<EOF
ClusterName=runkit
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/ctld
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdSpoolDir=$DIR/%n
SlurmdPidFile=$DIR/%n/slurmd.pid
SlurmdLogFile=$DIR/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
JobRequeue=1
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
SlurmdTimeout=120
InactiveLimit=0
KillWait=10
MinJobAge=3600
NodeName=${NODES[0]} NodeHostname=${NODES[0]} NodeAddr=127.0.0.1 Port=16818 CPUs=1 RealMemory=2000 State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=${NODES[1]} NodeAddr=127.0.0.1 Port=16819 CPUs=1 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF
}

up() {
    install
    write_config
    grep -qF "$HOSTS_LINE" /etc/hosts || echo "$HOSTS_LINE" >>/etc/hosts
    if ! pgrep -u munge -x munged >/dev/null; then
        mkdir -p /run/munge /var/lib/munge /var/log/munge
        chown munge:munge /run/munge /var/lib/munge /var/log/munge
        [[ -f /etc/munge/munge.key ]] || { runuser -u munge -- mungekey --create 2>/dev/null \
            || runuser -u munge -- /usr/sbin/create-munge-key -f; }
        runuser -u munge -- /usr/sbin/munged 9>&-  # daemons must not hold the lock
        touch "$DIR/started-munged"
    fi
    wait_for munged sh -c 'munge -n | unmunge'
    alive "$DIR/slurmctld.pid" || slurmctld -i 9>&-
    wait_for slurmctld scontrol ping
    for node in "${NODES[@]}"; do
        mkdir -p "$DIR/$node"
        alive "$DIR/$node/slurmd.pid" || slurmd -N "$node" 9>&-
    done
    # A drain outlives a restart in the saved state (a duplicate job id after a reset, a killed run):
    # this cluster is ours, so a start returns every node to service.
    for node in "${NODES[@]}"; do
        sinfo -h -N -n "$node" -o %T 2>/dev/null | grep -q drain \
            && scontrol update NodeName="$node" State=RESUME
    done
    wait_for "the nodes" sh -c "[ \"\$(sinfo -h -N -t idle,alloc,mix -o '%N %T' | grep -v drain \
        | sort -u | wc -l)\" = ${#NODES[@]} ]"
    echo "cluster: up (${NODES[*]}); export SLURM_CONF=$SLURM_CONF"
}

down() {
    for node in "${NODES[@]}"; do stop_pid "$DIR/$node/slurmd.pid"; done
    stop_pid "$DIR/slurmctld.pid"
    if [[ -f "$DIR/started-munged" ]]; then
        stop_pid /run/munge/munged.pid
        rm -f "$DIR/started-munged"
    fi
    if grep -qF "$HOSTS_LINE" /etc/hosts; then
        grep -vF "$HOSTS_LINE" /etc/hosts >"$DIR/hosts" && cat "$DIR/hosts" >/etc/hosts
    fi
    echo "cluster: stopped"
}

holds() { cat "$DIR/holds" 2>/dev/null || echo 0; }
case "${1:-}" in start | stop | reset) ;; *) fail "usage: $0 start|stop|reset (got '${1:-}')" ;; esac
[[ "$(id -u)" == 0 ]] || fail "cluster.sh runs the SLURM daemons as root; run it with sudo"
mkdir -p "$DIR"
exec 9>"$DIR/cluster.lock" && flock 9  # one start, stop or reset at a time
case "$1" in
start) up && echo $(($(holds) + 1)) >"$DIR/holds" ;;
stop)
    held=$(($(holds) - 1))
    if ((held > 0)); then
        echo "$held" >"$DIR/holds"
        echo "cluster: left running for the $held earlier start(s) still holding it"
    else
        down && rm -f "$DIR/holds"
    fi
    ;;
reset)  # the nodes forget their jobs too: a node that still knew an old job's id would drain
    if alive "$DIR/slurmctld.pid"; then
        scancel --quiet --user=root 2>/dev/null || true
        for _ in $(seq 150); do [[ -z "$(squeue -h 2>/dev/null)" ]] && break; sleep 0.2; done
    fi
    for node in "${NODES[@]}"; do stop_pid "$DIR/$node/slurmd.pid"; rm -rf "${DIR:?}/$node"; done
    stop_pid "$DIR/slurmctld.pid"
    rm -rf "$DIR/ctld"
    up
    ;;
esac
