#!/usr/bin/env bash
# The main job: set up, then run the default scenario (15 agents, s = 0.7, bundled MNIST digits,
# Sheaf-FRL) with `flwr run` on a private local SuperLink, offline, and print the final round.
# Extra arguments are passed as run-config overrides, e.g.: bash scripts/main.sh "lambda=0.0".
# The local SuperLink listens on port FLWR_SHEAF_PORT (default 29291) and FLWR_SHEAF_PORT + 2; ports
# already in use are refused before anything starts. FLWR_SHEAF_RAY_ADDRESS=host:port runs the
# ClientApps on that existing Ray cluster (docs/ray-cluster.md, "A Ray cluster"); unset, the run gets a
# private local Ray instance even where a `ray start` is running.
# Ctrl-C (or SIGTERM) stops the run and every process it started (the local SuperLink, Ray) and
# prints the command that runs it again (scripts/run_flwr.py); FLWR_SHEAF_SETUP=0 skips the setup and
# uses the Python environment already active.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${FLWR_SHEAF_SETUP:-1}" != 0 ]; then
  bash scripts/setup.sh
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
OUT="${RESULTS_DIR:-$PWD/results/default}"
# A results-dir holding an earlier run is refused by the ServerApp unless resume/overwrite is asked
# for; the main job keeps the earlier run instead of failing: it is moved aside, and said so.
# Whether a live run holds it is asked of the package (its kernel lock, also when its .lock was removed):
# a live run's directory is left to the preflight, which refuses this run.
if { [ -e "$OUT/results.json" ] || [ -e "$OUT/checkpoint.pkl" ]; } \
   && python -c 'import sys; from flwr_sheaf.rundir import main; sys.exit(main(sys.argv[1:]))' "$OUT"; then
  case "${1:-}" in
    *resume=true*|*overwrite=true*) ;;
    *) KEPT="$OUT.$(date +%Y%m%d-%H%M%S)"; mv "$OUT" "$KEPT"
       echo "main.sh: $OUT held an earlier run; moved to $KEPT (pass \"overwrite=true\" to replace it instead)" ;;
  esac
fi
# in the background, so that a signal to this script alone (kill, a job scheduler) is passed on at once
python scripts/run_flwr.py --num-supernodes 15 --cpus-per-client 1 --port "${FLWR_SHEAF_PORT:-29291}" \
  ${FLWR_SHEAF_RAY_ADDRESS:+--ray-address "$FLWR_SHEAF_RAY_ADDRESS"} --run-config "results-dir='$OUT' ${1:-}" \
  --rerun-as "bash scripts/main.sh" --rerun-config "${1:-}" &
RUN=$!
trap 'kill -TERM "$RUN" 2>/dev/null || true' INT TERM
rc=0
wait "$RUN" || rc=$?
while [ "$rc" -gt 128 ] && kill -0 "$RUN" 2>/dev/null; do  # a signal ended the wait, not the run
  rc=0
  wait "$RUN" || rc=$?
done
trap - INT TERM
[ "$rc" -eq 0 ] || exit "$rc"
python -m flwr_sheaf.report "$OUT/results.json"
