#!/usr/bin/env bash
# A two-node Slurm test cluster on this one machine: munged, slurmctld and slurmd -N n1|n2,
# every file under one cluster folder. Reference: docs/slurm.md. Run `cluster.sh --help`.
set -euo pipefail

readonly PROG=${0##*/}
readonly CLUSTER_DIR=${DRBALANCE_SLURM_DIR:-/tmp/drbalance-slurm}
readonly BASE_PORT=${DRBALANCE_SLURM_PORT:-6817}
readonly START_TIMEOUT=${DRBALANCE_SLURM_START_TIMEOUT:-120}  # seconds until both nodes are idle
readonly NODES=(n1 n2)
readonly NODE_ADDRS=(127.0.0.1 127.0.0.2)
readonly GPUS_PER_NODE=4
readonly SHARDS_PER_GPU=2      # Gres=gpu:4,shard:8
readonly CPUS_PER_NODE=8       # more than this machine has (SlurmdParameters=config_overrides), so
                               # several jobs fit on one node at once
readonly KILL_WAIT=5           # seconds between scancel's SIGTERM and SIGKILL (slurm.conf KillWait)
readonly CRED_EXPIRE=10        # seconds a step credential lives; a requeued job waits this long + 1
                               # before it may start again (Slurm's default: 120)
readonly SCHED_INTERVAL=2      # seconds between the scheduler's passes over pending jobs (Slurm's
                               # default: 60, backfill's 30): a requeued job starts within it once
                               # its wait is over
readonly DAEMON_STOP_WAIT=20   # seconds a daemon gets after SIGTERM before SIGKILL
readonly JOBS_END_WAIT=$((KILL_WAIT + 30))  # seconds `stop` waits for cancelled jobs to end
readonly EXIT_UNSUPPORTED=3    # this machine cannot host the cluster (not root, no apt-get, no mknod)
readonly GPU_DEVICE_MAJOR=195  # the NVIDIA driver's character-device major number
# Every process the script starts carries this variable in its environment: a pid read from a
# pid file is signalled only if its /proc environ has it (a stale pid file never kills a stranger),
# and `stop` finds what its daemons left (job steps' slurmstepd) by it.
readonly MARKER_NAME=DRBALANCE_SLURM_CLUSTER
readonly MARKER="$MARKER_NAME=$CLUSTER_DIR"

readonly ETC=$CLUSTER_DIR/etc
readonly SLURM_CONF_FILE=$ETC/slurm.conf
readonly MUNGE_DIR=$CLUSTER_DIR/munge
readonly MUNGE_SOCKET=$MUNGE_DIR/run/munge.socket
readonly MUNGE_PID=$MUNGE_DIR/run/munged.pid
readonly CTLD_DIR=$CLUSTER_DIR/ctld
readonly REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# Each node's manager, by default drbalance's system manager on the node's emulated GPUs, setting
# the node's Slurm Weight (docs/slurm.md); DRBALANCE_NODE_MANAGER_CMD=none: no node managers.
readonly DEFAULT_NODE_MANAGER="env PYTHONPATH=$REPO ${DRBALANCE_PYTHON:-python3} -m drbalance.manager.cli --system \
--source emulated:4 --policy fair --slurm-weight --slurm-node %n --slurm-weight-period 2 --sample-period 0.2"
NODE_MANAGER_CMD=${DRBALANCE_NODE_MANAGER_CMD-$DEFAULT_NODE_MANAGER}
[[ $NODE_MANAGER_CMD == none ]] && NODE_MANAGER_CMD=""
readonly NODE_MANAGER_CMD

usage() {
    cat <<EOF
Usage: $PROG start | env | stop | status | --help

A two-node Slurm cluster (nodes n1, n2) on this machine, for drbalance's Slurm tests and for
trying drbalance on Slurm by hand (docs/slurm.md). Runs as root; no systemd needed.

  start   install slurm-wlm and munge from Debian's packages if absent, write the
          configuration, start munged, slurmctld and one slurmd per node (and, if
          DRBALANCE_NODE_MANAGER_CMD is not 'none', one manager per node), and wait until both
          nodes are idle in sinfo. Says so and changes nothing if the cluster already runs.
  env     print the shell settings that reach the cluster: eval "\$($PROG env)"
  stop    cancel every job, end every process start started (by pid) and any job step
          left behind; fine when nothing runs. Logs stay in the cluster folder.
  status  what runs (exit 0: everything, 1: part of it, 3: nothing, 4: unknown: not root);
          start and stop need root too

Environment:
  DRBALANCE_SLURM_DIR            the cluster folder: configuration, state, logs, pid files,
                                 fake GPU device files [/tmp/drbalance-slurm]
  DRBALANCE_SLURM_PORT           slurmctld's TCP port; n1 and n2 listen on the next two [6817]
  DRBALANCE_SLURM_START_TIMEOUT  seconds start waits for both nodes to be idle [120]
  DRBALANCE_NODE_MANAGER_CMD     a command started once per node with the cluster, %n replaced
                                 by the node's name, in that node's environment (node.env),
                                 output to <cluster>/<node>/manager.log; stopped with it
                                 [drbalance's system manager on the node's 4 emulated GPUs, with
                                 --slurm-weight; 'none': no node managers]
  DRBALANCE_PYTHON               the Python with drbalance's dependencies that the default node
                                 manager runs with [python3]

Exit status: 0 done, 1 failed (the reason and the logs' last lines on stderr), 2 usage,
3 this machine cannot host the cluster (not root, packages not installable, no mknod).
EOF
}

say() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { say "$*"; exit 1; }
unsupported() { say "$*"; exit "$EXIT_UNSUPPORTED"; }

check_settings() {
    [[ $CLUSTER_DIR =~ ^/[A-Za-z0-9._/-]+$ && $CLUSTER_DIR != / ]] \
        || die "DRBALANCE_SLURM_DIR must be an absolute path of letters, digits and ._-/, not '$CLUSTER_DIR'"
    # munged's socket path must fit a sockaddr_un (108 bytes with its terminating NUL)
    ((${#MUNGE_SOCKET} < 108)) || die "DRBALANCE_SLURM_DIR is too long for munged's socket path: $MUNGE_SOCKET"
    [[ $BASE_PORT =~ ^[0-9]+$ ]] && ((BASE_PORT >= 1024 && BASE_PORT + ${#NODES[@]} <= 65535)) \
        || die "DRBALANCE_SLURM_PORT must be a TCP port 1024..$((65535 - ${#NODES[@]})), not '$BASE_PORT'"
    [[ $START_TIMEOUT =~ ^[0-9]+$ ]] && ((START_TIMEOUT > 0)) \
        || die "DRBALANCE_SLURM_START_TIMEOUT must be a positive number of seconds, not '$START_TIMEOUT'"
}

# --- processes ------------------------------------------------------------------------------

# is_alive PID: PID names a process that is not a zombie.
is_alive() {
    local stat
    [[ $1 =~ ^[0-9]+$ ]] || return 1
    { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
    stat=${stat##*) }  # the fields after the command's name, the state first
    [[ -n $stat && ${stat:0:1} != Z ]]
}

# has_marker PID: the process's environment has this cluster's marker.
has_marker() { grep -qzxF -- "$MARKER" "/proc/$1/environ" 2>/dev/null; }

# is_cluster_step PID: a slurmstepd of this cluster's slurmds. slurmstepd writes its process
# title over its environment, marker included; it runs in its node's folder.
is_cluster_step() {
    [[ $(readlink "/proc/$1/exe" 2>/dev/null) == */slurmstepd* ]] \
        && [[ $(readlink "/proc/$1/cwd" 2>/dev/null) == "$CLUSTER_DIR"/* ]]
}

# is_ours PID: PID is alive and a process this cluster started.
is_ours() { is_alive "$1" && { has_marker "$1" || is_cluster_step "$1"; }; }

# pid_from FILE: the pid in FILE if that process is ours and alive, else nothing (status 1).
pid_from() {
    local pid
    [[ -f $1 ]] || return 1
    pid=$(tr -dc '0-9' <"$1")
    is_ours "$pid" || return 1
    echo "$pid"
}

# stop_pid NAME PID [group]: SIGTERM (with "group": to PID's process group, which PID leads),
# then SIGKILL after DAEMON_STOP_WAIT seconds.
stop_pid() {
    local name=$1 pid=$2 target=$2 tenths=$((DAEMON_STOP_WAIT * 10))
    [[ ${3:-} == group ]] && target=-$pid
    is_ours "$pid" || return 0
    kill -TERM -- "$target" 2>/dev/null || true
    while ((tenths-- > 0)); do
        is_ours "$pid" || return 0
        sleep 0.1
    done
    say "$name (pid $pid) outlived SIGTERM by ${DAEMON_STOP_WAIT} s: SIGKILL"
    kill -KILL -- "$target" 2>/dev/null || true
}

# wait_for_pid_file NAME FILE LOG: the daemon NAME wrote FILE (it daemonizes itself).
wait_for_pid_file() {
    local name=$1 file=$2 log=$3 tenths=300
    while ((tenths-- > 0)); do
        pid_from "$file" >/dev/null && return 0
        sleep 0.1
    done
    start_failed "$name did not start (no live process in $file)" "$log"
}

# Pids of this cluster's processes (but this script) and all their descendants: after `stop`
# has ended the daemons, what is left (a job step's slurmstepd and its tasks, a node manager's
# children).
leftover_pids() {
    local pid roots=() candidates
    # candidates: a marker in the environment, or a slurmstepd (the process's name); each checked
    candidates=$(
        grep -lzxF -- "$MARKER" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
        ps -eo pid=,comm= | awk '$2 ~ /^slurmstepd/ { print $1 }'
    )
    for pid in $candidates; do
        [[ $pid == "$$" || $pid == "$BASHPID" ]] && continue
        is_ours "$pid" && roots+=("$pid")
    done
    ((${#roots[@]} > 0)) || return 0
    ps -eo pid=,ppid= | awk -v roots="${roots[*]}" '
        BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
        { parent[$1] = $2 }
        END {
            do { grown = 0; for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; grown = 1 } } while (grown)
            for (p in keep) print p
        }'
}

# --- installation ---------------------------------------------------------------------------

readonly REQUIRED_COMMANDS=(munged mungekey slurmctld slurmd sinfo srun sbatch squeue scancel scontrol)

ensure_packages() {
    local missing=() command
    for command in "${REQUIRED_COMMANDS[@]}"; do
        PATH=/usr/sbin:/usr/bin:$PATH command -v "$command" >/dev/null || missing+=("$command")
    done
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null || unsupported "needs ${missing[*]} (slurm-wlm, munge) and this machine has no apt-get"
    say "installing slurm-wlm and munge (missing: ${missing[*]})"
    local log=/tmp/drbalance-slurm-apt.$$.log
    # One installation at a time from this script (other worktrees' tests may start clusters at
    # once); apt's own locks are waited for, not failed on, when something else holds them.
    local apt=(apt-get -q -o DPkg::Lock::Timeout=300)
    if ! flock /var/lock/drbalance-slurm-apt.lock bash -c '"$@" update && DEBIAN_FRONTEND=noninteractive "$@" install -y slurm-wlm munge' \
        apt "${apt[@]}" >"$log" 2>&1; then
        tail -n 15 "$log" >&2
        # a failure, not "unsupported": the tests must not pass by skipping an install that broke
        die "cannot install slurm-wlm and munge from Debian's packages (apt-get's output: $log)"
    fi
    rm -f "$log"
}

# --- the cluster folder ---------------------------------------------------------------------

# The folder must be ours: a directory (not a link) owned by root, writable by nobody else.
check_cluster_dir() {
    local owner mode
    [[ -e $CLUSTER_DIR || -L $CLUSTER_DIR ]] || return 0
    [[ -d $CLUSTER_DIR && ! -L $CLUSTER_DIR ]] || die "$CLUSTER_DIR is not a directory (or is a symbolic link)"
    read -r owner mode < <(stat -c '%u %a' "$CLUSTER_DIR")
    [[ $owner == 0 ]] || die "$CLUSTER_DIR belongs to uid $owner, not root: refusing to use it"
    (((8#$mode & 8#022) == 0)) || die "$CLUSTER_DIR is writable by group or others (mode $mode): refusing to use it"
}

# lock_cluster_dir FLOCK_OPTION...: one start or stop at a time per cluster folder (made if
# absent). The lock is on the folder itself, fd 9, held until the script exits; every daemon
# starts with fd 9 closed.
lock_cluster_dir() {
    check_cluster_dir
    install -d -m 0755 "$CLUSTER_DIR"
    check_cluster_dir
    exec 9<"$CLUSTER_DIR"
    flock "$@" 9 || die "another '$PROG' start or stop is working on $CLUSTER_DIR"
}

# Start from an empty cluster folder: no state, spool or pid file of an earlier run.
fresh_cluster_dir() {
    find "$CLUSTER_DIR" -mindepth 1 -maxdepth 1 -exec rm -rf -- {} +
    install -d -m 0755 "$ETC" "$CTLD_DIR" "$CTLD_DIR/state"
    local node
    for node in "${NODES[@]}"; do
        install -d -m 0755 "$CLUSTER_DIR/$node" "$CLUSTER_DIR/$node/spool" "$CLUSTER_DIR/$node/dev"
    done
}

# The variables a node gives its node manager and every task of its jobs, one NAME=value a line.
# Each node has its own drbalance system folder, as each machine of a real cluster does.
node_environment() {
    local node=$1
    echo "DRBALANCE_SYSTEM_DIR=$CLUSTER_DIR/$node/system"
    echo "DRBALANCE_EMULATED_GPUS=$GPUS_PER_NODE"  # the node's GPUs are emulated: jobs train on them
}

# GPU device files: nodes n1, n2 get minor numbers 0-3 and 4-7 (no two nodes share a file).
make_gpu_devices() {
    local index node gpu minor=0
    for index in "${!NODES[@]}"; do
        node=${NODES[$index]}
        for ((gpu = 0; gpu < GPUS_PER_NODE; gpu++)); do
            mknod -m 0666 "$CLUSTER_DIR/$node/dev/nvidia$gpu" c "$GPU_DEVICE_MAJOR" "$minor" 2>/dev/null \
                || unsupported "cannot make GPU device files (mknod $CLUSTER_DIR/$node/dev/nvidia$gpu): needs CAP_MKNOD"
            minor=$((minor + 1))
        done
    done
}

write_config() {
    local index node port gpu shards=$((GPUS_PER_NODE * SHARDS_PER_GPU))
    for node in "${NODES[@]}"; do
        node_environment "$node" >"$CLUSTER_DIR/$node/node.env"
    done
    {
        echo "# Written by tests/slurm/cluster.sh start; rewritten at every start (docs/slurm.md)."
        echo "ClusterName=drbalance"
        echo "SlurmctldHost=$(hostname -s)(127.0.0.1)"
        echo "SlurmctldPort=$BASE_PORT"
        echo "SlurmUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=socket=$MUNGE_SOCKET,cred_expire=$CRED_EXPIRE"
        echo "StateSaveLocation=$CTLD_DIR/state"
        echo "SlurmctldPidFile=$CTLD_DIR/slurmctld.pid"
        echo "SlurmctldLogFile=$CTLD_DIR/slurmctld.log"
        echo "SlurmdSpoolDir=$CLUSTER_DIR/%n/spool"
        echo "SlurmdPidFile=$CLUSTER_DIR/%n/slurmd.pid"
        echo "SlurmdLogFile=$CLUSTER_DIR/%n/slurmd.log"
        echo "SlurmctldDebug=info"
        echo "SlurmdDebug=info"
        echo "# No cgroups or systemd here: processes tracked through /proc, tasks not bound."
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobCompType=jobcomp/none"
        echo "MpiDefault=none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "SlurmdParameters=config_overrides"
        echo "GresTypes=gpu,shard"
        echo "SchedulerParameters=sched_interval=$SCHED_INTERVAL,bf_interval=$SCHED_INTERVAL"
        echo "KillWait=$KILL_WAIT"
        echo "ReturnToService=2"
        echo "TaskProlog=$ETC/task_prolog.sh"
        for index in "${!NODES[@]}"; do
            node=${NODES[$index]}
            port=$((BASE_PORT + 1 + index))
            echo "NodeName=$node NodeAddr=${NODE_ADDRS[$index]} Port=$port CPUs=$CPUS_PER_NODE RealMemory=4096" \
                "Gres=gpu:$GPUS_PER_NODE,shard:$shards State=UNKNOWN"
        done
        echo "PartitionName=main Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
    } >"$SLURM_CONF_FILE"
    {
        echo "# Fake GPUs: character devices of major $GPU_DEVICE_MAJOR, $SHARDS_PER_GPU shards each."
        echo "AutoDetect=off"
        for node in "${NODES[@]}"; do
            for ((gpu = 0; gpu < GPUS_PER_NODE; gpu++)); do
                echo "NodeName=$node Name=gpu File=$CLUSTER_DIR/$node/dev/nvidia$gpu"
            done
            for ((gpu = 0; gpu < GPUS_PER_NODE; gpu++)); do
                echo "NodeName=$node Name=shard Count=$SHARDS_PER_GPU File=$CLUSTER_DIR/$node/dev/nvidia$gpu"
            done
        done
    } >"$ETC/gres.conf"
    cat >"$ETC/task_prolog.sh" <<EOF
#!/bin/sh
# Slurm's TaskProlog: runs as the job's user before every task; each "export NAME=value" line it
# prints is set in that task's environment. Gives the task its node's variables (node.env).
env_file="$CLUSTER_DIR/\$SLURMD_NODENAME/node.env"
[ -r "\$env_file" ] || exit 0
while IFS= read -r line; do
    case \$line in
        ''|'#'*) ;;
        *) printf 'export %s\n' "\$line" ;;
    esac
done <"\$env_file"
EOF
    chmod 0644 "$SLURM_CONF_FILE" "$ETC/gres.conf"
    chmod 0755 "$ETC/task_prolog.sh"
}

# --- daemons --------------------------------------------------------------------------------

# Every daemon starts with the marker, SLURM_CONF and stdin/stdout/stderr away from the caller's
# pipes (a test capturing start's output would otherwise wait for the daemons to end).
start_munged() {
    install -d -m 0755 -o munge -g munge "$MUNGE_DIR" "$MUNGE_DIR/run"
    install -d -m 0700 -o munge -g munge "$MUNGE_DIR/key" "$MUNGE_DIR/lib" "$MUNGE_DIR/log"
    mungekey --create --keyfile="$MUNGE_DIR/key/munge.key" >/dev/null
    chown munge:munge "$MUNGE_DIR/key/munge.key"
    chmod 0600 "$MUNGE_DIR/key/munge.key"
    env "$MARKER" setpriv --reuid=munge --regid=munge --init-groups \
        munged --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/key/munge.key" --pid-file="$MUNGE_PID" \
        --log-file="$MUNGE_DIR/log/munged.log" --seed-file="$MUNGE_DIR/lib/munged.seed" \
        </dev/null >"$MUNGE_DIR/munged.out" 2>&1 9>&- \
        || start_failed "munged did not start" "$MUNGE_DIR/munged.out" "$MUNGE_DIR/log/munged.log"
    wait_for_pid_file munged "$MUNGE_PID" "$MUNGE_DIR/log/munged.log"
}

start_slurmctld() {
    env "$MARKER" SLURM_CONF="$SLURM_CONF_FILE" slurmctld \
        </dev/null >"$CTLD_DIR/slurmctld.out" 2>&1 9>&- \
        || start_failed "slurmctld did not start" "$CTLD_DIR/slurmctld.out" "$CTLD_DIR/slurmctld.log"
    wait_for_pid_file slurmctld "$CTLD_DIR/slurmctld.pid" "$CTLD_DIR/slurmctld.log"
}

start_slurmd() {
    local node=$1 dir=$CLUSTER_DIR/$1 variables
    mapfile -t variables <"$dir/node.env"
    env "$MARKER" SLURM_CONF="$SLURM_CONF_FILE" "${variables[@]}" slurmd -N "$node" \
        </dev/null >"$dir/slurmd.out" 2>&1 9>&- \
        || start_failed "slurmd -N $node did not start" "$dir/slurmd.out" "$dir/slurmd.log"
    wait_for_pid_file "slurmd -N $node" "$dir/slurmd.pid" "$dir/slurmd.log"
}

# The hook for drbalance's system manager, one per node: DRBALANCE_NODE_MANAGER_CMD with %n
# replaced by the node's name, run by `bash -c` (which execs a simple command, so the pid is the
# command's) in a session of its own, in the node's folder, with the node's variables (node.env)
# and SLURM_CONF; its pid in <node>/manager.pid, its output in <node>/manager.log. Started
# before the slurmds (so it runs before any job); stopped after every job has ended, by SIGTERM
# to its process group.
start_node_managers() {
    [[ -n $NODE_MANAGER_CMD ]] || return 0
    local node dir command variables pid
    for node in "${NODES[@]}"; do
        dir=$CLUSTER_DIR/$node
        command=${NODE_MANAGER_CMD//%n/$node}
        mapfile -t variables <"$dir/node.env"
        # Not a process-group leader, so setsid makes the session without a fork: $! stays the
        # manager's pid through setsid's and bash's exec.
        (cd "$dir" && exec env "$MARKER" SLURM_CONF="$SLURM_CONF_FILE" "${variables[@]}" \
            setsid bash -c "$command") </dev/null >"$dir/manager.log" 2>&1 9>&- &
        pid=$!
        echo "$pid" >"$dir/manager.pid"
        sleep 0.2
        is_ours "$pid" || start_failed "the node manager of $node ended at once: $command" "$dir/manager.log"
    done
}

check_node_managers_alive() {
    [[ -n $NODE_MANAGER_CMD ]] || return 0
    local node
    for node in "${NODES[@]}"; do
        pid_from "$CLUSTER_DIR/$node/manager.pid" >/dev/null \
            || start_failed "the node manager of $node has ended" "$CLUSTER_DIR/$node/manager.log"
    done
}

node_states() { SLURM_CONF=$SLURM_CONF_FILE sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }

wait_until_idle() {
    local deadline=$((SECONDS + START_TIMEOUT)) states expected
    expected=$(printf '%s idle\n' "${NODES[@]}")
    while ((SECONDS < deadline)); do
        states=$(node_states || true)
        [[ $states == "$expected" ]] && return 0
        check_node_managers_alive
        sleep 0.5
    done
    local logs=("$CTLD_DIR/slurmctld.log") node
    for node in "${NODES[@]}"; do logs+=("$CLUSTER_DIR/$node/slurmd.log"); done
    start_failed "the nodes are not idle after ${START_TIMEOUT} s; sinfo says: ${states:-nothing}" "${logs[@]}"
}

# start_failed REASON LOG...: the logs' last lines, everything started stopped, exit 1.
start_failed() {
    local reason=$1 log
    shift
    for log in "$@"; do
        [[ -f $log ]] || continue
        printf '%s: --- last lines of %s ---\n' "$PROG" "$log" >&2
        tail -n 20 "$log" >&2
    done
    say "start failed: $reason"
    stop_everything >/dev/null 2>&1 || true
    exit 1
}

# --- the commands ---------------------------------------------------------------------------

# name<TAB>pid file, for every process start starts, in the order stop ends them.
tracked() {
    local node
    for node in "${NODES[@]}"; do printf 'slurmd -N %s\t%s\n' "$node" "$CLUSTER_DIR/$node/slurmd.pid"; done
    printf 'slurmctld\t%s\n' "$CTLD_DIR/slurmctld.pid"
    for node in "${NODES[@]}"; do printf 'node manager %s\t%s\n' "$node" "$CLUSTER_DIR/$node/manager.pid"; done
    printf 'munged\t%s\n' "$MUNGE_PID"
}

# Prints "running" "partly" or "stopped".
cluster_state() {
    local name file alive=0 total=0
    while IFS=$'\t' read -r name file; do
        [[ $name == node\ manager* && ! -f $file ]] && continue  # no node manager asked for
        total=$((total + 1))
        pid_from "$file" >/dev/null && alive=$((alive + 1))
    done < <(tracked)
    if ((alive == 0)); then echo stopped; elif ((alive == total)); then echo running; else echo partly; fi
}

cmd_start() {
    ((EUID == 0)) || unsupported "start needs root (slurmd starts jobs as their users; munged runs as munge)"
    check_settings
    lock_cluster_dir -n
    local state
    state=$(cluster_state)
    if [[ $state == running ]]; then
        say "already running in $CLUSTER_DIR (status: $PROG status); nothing changed"
        return 0
    elif [[ $state == partly ]]; then
        cmd_status >&2 || true
        die "partly running in $CLUSTER_DIR: run '$PROG stop' first"
    elif [[ -n $(leftover_pids) ]]; then
        die "processes of an earlier run in $CLUSTER_DIR are still there ($(echo $(leftover_pids))): run '$PROG stop' first"
    fi
    ensure_packages
    export PATH=/usr/sbin:/usr/bin:$PATH
    local port
    for ((port = BASE_PORT; port <= BASE_PORT + ${#NODES[@]}; port++)); do
        [[ -z $(ss -Hltn "sport = :$port") ]] \
            || die "TCP port $port is in use; choose other ports with DRBALANCE_SLURM_PORT (it uses $BASE_PORT..$((BASE_PORT + ${#NODES[@]})))"
    done
    fresh_cluster_dir
    make_gpu_devices
    write_config
    start_munged
    start_node_managers
    start_slurmctld
    local node
    for node in "${NODES[@]}"; do start_slurmd "$node"; done
    wait_until_idle
    say "running in $CLUSTER_DIR: nodes ${NODES[*]} idle (settings: $PROG env)"
}

cmd_env() {
    check_settings
    echo "export SLURM_CONF=$SLURM_CONF_FILE"
    echo "export DRBALANCE_SLURM_DIR=$CLUSTER_DIR"
    # The clients (sinfo, srun, sbatch, ...) are in /usr/bin; nothing to add to PATH.
}

cancel_all_jobs() {
    local jobs deadline=$((SECONDS + JOBS_END_WAIT))
    pid_from "$CTLD_DIR/slurmctld.pid" >/dev/null || return 0
    export SLURM_CONF=$SLURM_CONF_FILE
    jobs=$(squeue -h -o %A 2>/dev/null || true)
    [[ -n $jobs ]] || return 0
    say "cancelling jobs: $(echo $jobs)"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    while ((SECONDS < deadline)); do
        [[ -z $(squeue -h -o %A 2>/dev/null || true) ]] && return 0
        sleep 0.5
    done
    say "jobs still listed after ${JOBS_END_WAIT} s: $(squeue -h -o '%A %T %N' 2>/dev/null | tr '\n' ';')"
}

stop_everything() {
    local name file pid
    cancel_all_jobs
    while IFS=$'\t' read -r name file; do
        if pid=$(pid_from "$file"); then
            if [[ $name == node\ manager* ]]; then stop_pid "$name" "$pid" group; else stop_pid "$name" "$pid"; fi
            say "stopped $name (pid $pid)"
        fi
    done < <(tracked)
    # What the daemons left: job steps' slurmstepd (and their tasks) carry the marker too.
    local leftovers
    leftovers=$(leftover_pids)
    if [[ -n $leftovers ]]; then
        say "ending processes left behind: $(echo $leftovers)"
        for pid in $leftovers; do kill -KILL "$pid" 2>/dev/null || true; done
        local tenths=$((DAEMON_STOP_WAIT * 10))
        for pid in $leftovers; do
            while is_alive "$pid" && ((tenths-- > 0)); do sleep 0.1; done
            is_alive "$pid" && say "pid $pid is still there after SIGKILL (uninterruptible?)"
        done
    fi
    while IFS=$'\t' read -r name file; do rm -f -- "$file"; done < <(tracked)
}

cmd_stop() {
    ((EUID == 0)) || unsupported "stop needs root"
    check_settings
    check_cluster_dir
    [[ -d $CLUSTER_DIR ]] || { say "not running (no $CLUSTER_DIR)"; return 0; }
    lock_cluster_dir -w 60
    if [[ $(cluster_state) == stopped && -z $(leftover_pids) ]]; then
        say "not running in $CLUSTER_DIR"
        return 0
    fi
    stop_everything
    say "stopped; logs are in $CLUSTER_DIR"
}

cmd_status() {
    ((EUID == 0)) || { say "status needs root (it checks each pid's environment)"; exit 4; }
    check_settings
    local name file pid state
    while IFS=$'\t' read -r name file; do
        [[ $name == node\ manager* && ! -f $file ]] && continue
        if pid=$(pid_from "$file"); then echo "$name: running (pid $pid)"; else echo "$name: not running"; fi
    done < <(tracked)
    state=$(cluster_state)
    if pid_from "$CTLD_DIR/slurmctld.pid" >/dev/null; then
        SLURM_CONF=$SLURM_CONF_FILE sinfo -N -o '%N %t %G' 2>&1 || true
    fi
    echo "cluster in $CLUSTER_DIR: $state"
    case $state in running) return 0 ;; partly) return 1 ;; *) return 3 ;; esac
}

main() {
    (($# == 1)) || { usage >&2; exit 2; }
    case $1 in
        start) cmd_start ;;
        env) cmd_env ;;
        stop) cmd_stop ;;
        status) cmd_status ;;
        -h | --help | help) usage ;;
        *) usage >&2; exit 2 ;;
    esac
}

main "$@"
