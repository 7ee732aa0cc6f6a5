#!/usr/bin/env bash
# How long README's test command takes in a fresh clone: quiet, then beside two busy loops; then
# the slow tier that CI runs after it.
#
#   benchmarks/suite_time.sh [WORKDIR]     # default WORKDIR: a new folder under /tmp
#
# Each pass runs in its own fresh clone of this checkout's HEAD with a fresh venv (pip's cache
# helps every pass alike). Pass "busy" has two `python3 -c "while True: pass"` processes beside
# it: on a 2-core machine, more runnable work than cores. Pass "slow" runs `pytest -m slow` in
# the quiet pass's venv. Each pass's output is WORKDIR/<pass>.txt; one line per pass (exit
# status, wall seconds, load average, pytest's last line) goes to WORKDIR/summary.txt and to
# stdout. The clones are removed at the end. docs/testing.md states the result; benchmarks/results/suite_time.txt keeps it.
set -u
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
work=${1:-$(mktemp -d /tmp/drbalance-suite-time.XXXXXX)}
chmod 755 "$work"  # tests that run as other users (setpriv) read the clones' code and venv
command=$(grep -E '^    .*pytest -q -n 2' "$repo/README.md" | sed 's/^    //')
[ -n "$command" ] || { echo "README.md has no test command" >&2; exit 2; }
echo "commit $(git -C "$repo" rev-parse --short HEAD), $(nproc) cores; command: $command" | tee "$work/summary.txt"
run_pass() {  # name, then the command line
  local name=$1 start status
  start=$(date +%s)
  bash -c "$2" > "$work/$name.txt" 2>&1
  status=$?
  echo "$name exit=$status seconds=$(( $(date +%s) - start )) load=$(cut -d' ' -f1-3 /proc/loadavg)" \
       "$(tail -1 "$work/$name.txt")" | tee -a "$work/summary.txt"
}
git clone -q "$repo" "$work/quiet" && cd "$work/quiet" && run_pass quiet "$command"
run_pass slow ".venv/bin/python -m pytest -q -n 2 -m slow"
git clone -q "$repo" "$work/busy" && cd "$work/busy" || exit 1
python3 -c "while True: pass" & burner1=$!
python3 -c "while True: pass" & burner2=$!
trap 'kill $burner1 $burner2' EXIT
run_pass busy "$command"
# Each clone's venv holds a CUDA build of torch (about 6 GB): the outputs stay, the clones go.
rm -rf "$work/quiet" "$work/busy"
