#!/usr/bin/env bash
# Whether the suite holds on a busy machine: the whole suite three times in a row
# with two CPU-burning processes beside it (on a 2-core machine: more runnable work than cores).
#
#   benchmarks/suite_under_load.sh [WORKDIR]      # default WORKDIR: a new folder under /tmp
#
# Pass 1 is README's test command, verbatim, in a fresh clone of this checkout's HEAD (a fresh
# venv); passes 2 and 3 reuse that venv. Each pass's output goes to WORKDIR/passN.txt, one line
# per pass to WORKDIR/summary.txt (exit status, seconds, load average, pytest's last line).
# A background job of a non-interactive shell (setsid or not) inherits SIGINT ignored, and so does
# every process it starts; the suite copes with that (tests that send SIGINT start their child with
# it at its default, as a terminal would), but a reader of the results should know how it ran.
set -u
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
work=${1:-$(mktemp -d /tmp/drbalance-under-load.XXXXXX)}
git clone -q "$repo" "$work/clone"
cd "$work/clone" || exit 1
echo "commit $(git rev-parse --short HEAD)" > "$work/summary.txt"
python3 -c "while True: pass" & burner1=$!
python3 -c "while True: pass" & burner2=$!
trap 'kill $burner1 $burner2' EXIT
for pass in 1 2 3; do
  start=$(date +%s)
  if [ "$pass" = 1 ]; then
    command="python3 -m venv .venv && .venv/bin/python -m pip install -q -e '.[test]' && .venv/bin/ruff check . && .venv/bin/python -m pytest -q -n 2"
  else
    command=".venv/bin/ruff check . && .venv/bin/python -m pytest -q -n 2"
  fi
  bash -c "$command" > "$work/pass$pass.txt" 2>&1
  status=$?
  echo "pass $pass exit=$status seconds=$(( $(date +%s) - start )) load=$(cut -d' ' -f1-3 /proc/loadavg)" \
       "$(tail -1 "$work/pass$pass.txt")" >> "$work/summary.txt"
done
cat "$work/summary.txt"
