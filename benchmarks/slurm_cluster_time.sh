#!/usr/bin/env bash
# How long the Slurm test cluster (tests/slurm/cluster.sh) takes to start and to stop: alone (pass
# "alone": nothing added to the machine's load) and beside two busy loops (pass "busy": on a
# 2-core machine, more runnable work than cores). Each pass notes the load average.
#
#   bash benchmarks/slurm_cluster_time.sh [CYCLES]     # default 5 cycles per pass; needs root
#
# Each cycle: `cluster.sh start` (packages already installed), `cluster.sh stop` of the idle
# cluster, `start` again, one `sleep` job per node, `stop` (which cancels them first). The cluster
# lives in a folder of its own on free ports, so a cluster already running here is not touched.
# One line per measurement and the medians go to stdout and to
# benchmarks/results/slurm_cluster_time.txt; docs/slurm.md states them.
set -euo pipefail
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
script=$repo/tests/slurm/cluster.sh
result=$repo/benchmarks/results/slurm_cluster_time.txt
cycles=${1:-5}
[[ $cycles =~ ^[1-9][0-9]*$ ]] || { echo "CYCLES must be a positive whole number, not '$cycles'" >&2; exit 2; }
((EUID == 0)) || { echo "needs root, as cluster.sh does" >&2; exit 2; }

export DRBALANCE_SLURM_DIR=/tmp/drbalance-slurm-bench.$$
for ((port = 30000; port < 60000; port += 3)); do
    [[ -z $(ss -Hltn "( sport >= :$port and sport <= :$((port + 2)) )") ]] && break
done
export DRBALANCE_SLURM_PORT=$port
burners=()
cleanup() {
    ((${#burners[@]} == 0)) || kill "${burners[@]}" 2>/dev/null || true
    bash "$script" stop >/dev/null 2>&1 || true
    rm -rf -- "$DRBALANCE_SLURM_DIR" "$DRBALANCE_SLURM_DIR.log"
}
trap cleanup EXIT

seconds() {  # the wall seconds of the command, to 0.01 s; the command's output to the log
    local began=$EPOCHREALTIME
    "$@" >>"$DRBALANCE_SLURM_DIR.log" 2>&1 || { echo "failed: $* (log: $DRBALANCE_SLURM_DIR.log)" >&2; exit 1; }
    awk -v a="$began" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }'
}

median() { sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

run_pass() {  # name
    local name=$1 cycle start_s stop_idle_s stop_jobs_s starts=() idle_stops=() job_stops=() node
    for ((cycle = 1; cycle <= cycles; cycle++)); do
        start_s=$(seconds bash "$script" start)
        stop_idle_s=$(seconds bash "$script" stop)
        starts+=("$start_s" "$(seconds bash "$script" start)")
        for node in n1 n2; do
            SLURM_CONF=$DRBALANCE_SLURM_DIR/etc/slurm.conf sbatch -w "$node" -o /dev/null --chdir=/tmp --wrap "sleep 600" \
                >>"$DRBALANCE_SLURM_DIR.log"
        done
        until [[ $(SLURM_CONF=$DRBALANCE_SLURM_DIR/etc/slurm.conf squeue -h -t R -o %A | wc -l) == 2 ]]; do sleep 0.2; done
        stop_jobs_s=$(seconds bash "$script" stop)
        idle_stops+=("$stop_idle_s")
        job_stops+=("$stop_jobs_s")
        echo "$name cycle $cycle: start ${start_s} s, ${starts[-1]} s; stop idle ${stop_idle_s} s; stop with 2 jobs ${stop_jobs_s} s"
    done
    echo "$name medians: start $(printf '%s\n' "${starts[@]}" | median) s," \
         "stop idle $(printf '%s\n' "${idle_stops[@]}" | median) s," \
         "stop with 2 jobs $(printf '%s\n' "${job_stops[@]}" | median) s (load $(cut -d' ' -f1-3 /proc/loadavg))"
}

exec > >(tee "$result")
echo "$(nproc) cores, $(slurmd -V), $cycles cycles per pass, cluster.sh start/stop (packages installed)"
run_pass alone
python3 -c "while True: pass" >/dev/null 2>&1 & burners+=($!)
python3 -c "while True: pass" >/dev/null 2>&1 & burners+=($!)
run_pass busy
