#!/usr/bin/env bash
# One prepared GPU session (issue "GPUs for real"; docs/devices.md, "The prepared GPU session").
# Run from the repository root on a CUDA machine whose python3 has torch. flwr, Ray (trimmed) and the
# other missing packages come from the device bundle in .bundle/ (tools/device_bundle.py), the
# data from .bundle-data/ (or $FLWR_SHEAF_DATA). Everything it measures goes to $OUT as soon as it
# exists (a run stopped at its limit still returns what it measured); at most 8 files:
#   session.log, summary.jsonl (one line per finished step), gpu_tests.xml, floor.json,
#   profile.txt, concurrency.jsonl, runs.tgz (every run's results.json, refreshed every 20 s).
# Steps (STEPS, default "a b c d e"; each under its own timeout):
#   a  the device tests                      c  flwr run on Ray's engine, 15 SuperNodes sharing the GPU
#   b  floor vs product + profile            d  the study: Sheaf-FRL vs lambda = 0 (strong post-hoc), 100 epochs
#   e  k in-process runs sharing the device (concurrency curve)
# The study's epochs per run are EPOCHS (default 100), as local-epochs x server rounds; its wall budget
# STUDY_BUDGET (default: what is left of BUDGET=540 s); if the measured epoch time cannot fit all
# EPOCHS in the budget, the rounds are cut to fit and the horizon reached is logged in summary.jsonl.
#   SMOKE=1 bash benchmarks/gpu_session.sh   # the same steps, tiny, on CPU (CI runs this)
set -uo pipefail
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
OUT="${OUT:-results/gpu_session}"; mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
WORK="${WORK:-$(mktemp -d /tmp/gpu_session.XXXXXX)}"; mkdir -p "$WORK"
exec > >(tee -a "$OUT/session.log") 2>&1
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
BUDGET="${BUDGET:-540}"; left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
STEPS=" ${STEPS-a b c d e} "; want() { [[ "$STEPS" == *" $1 "* ]]; }
note() { echo "$1" >> "$OUT/summary.jsonl"; }
snapshot() { tar czf "$OUT/runs.tgz.part" -C "$WORK" --exclude='*.log' --exclude='*.pkl' --exclude='*.png' --exclude='node-state' . 2>/dev/null && mv "$OUT/runs.tgz.part" "$OUT/runs.tgz"; }
( while sleep 20; do snapshot; done ) & SNAP=$!
trap 'kill $SNAP 2>/dev/null; snapshot; el "done (work in $WORK)"' EXIT

PY="${PY:-python3}"
# The device bundle (tools/device_bundle.py): packages in .bundle/, data in .bundle-data/ (two
# back-to-back runs when both do not fit one carry: docs/devices.md); /tmp/site lasts while warm.
for b in .bundle .bundle-data; do
  if [ -z "${SMOKE:-}" ] && [ -f "$b/manifest.json" ]; then
    el "installing $b"
    $PY tools/device_bundle.py install "$b" --target /tmp/site --data-dir .gpudata \
      || { note "{\"step\": \"install $b\", \"ok\": false}"; exit 1; }
  fi
done
[ -d /tmp/site ] && [ -z "${SMOKE:-}" ] && export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
[ -d .gpudata ] && export FLWR_SHEAF_DATA="$PWD/.gpudata"
if [ -n "${SMOKE:-}" ]; then
  DEV=cpu; ZOO=tiny-3; DS=mnist-bundled; EXTRA="graph=ring num-pilots=64 max-steps-per-epoch=2"; EPOCHS=${EPOCHS:-2}
  NSN=3; GPUS=0; KS="1 2"; WORKERS=2
else
  DEV=cuda; ZOO=paper-15; DS=fashion-mnist; EXTRA=""; EPOCHS=${EPOCHS:-100}; NSN=15; GPUS=0.066; KS="1 2 4 8"; WORKERS=6
fi
el "environment"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
$PY -c "import torch, flwr, flwr_sheaf; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', '| flwr', flwr.__version__, '| cpus', __import__('os').cpu_count())" \
  || { note '{"step": "environment", "ok": false}'; exit 1; }

if want a; then
  el "a. device tests (every method end to end on $DEV; SMOKE: only collected, they need CUDA)"
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_devices.py -rs ${SMOKE:+-m gpu} --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -15
  note "{\"step\": \"a\", \"rc\": ${PIPESTATUS[0]}}"
fi

EPOCH=""
if want b; then
  el "b. floor vs product per epoch, $ZOO on $DS, preset=paper, device=$DEV (+ profile of a third round)"
  timeout 200 $PY benchmarks/floor.py --device $DEV --zoo $ZOO --dataset $DS --profile --extra $EXTRA --out "$WORK/floor" 2>&1 | grep -v "^\[flwr-sheaf\]" | head -8
  cp "$WORK"/floor/floor-*.json "$OUT/floor.json" 2>/dev/null; cp "$WORK"/floor/profile-*.txt "$OUT/profile.txt" 2>/dev/null
  EPOCH=$($PY -c "import json; print(json.load(open('$OUT/floor.json'))['product']['glued_epoch']['wall_s'])" 2>/dev/null)
  note "{\"step\": \"b\", \"ok\": $([ -n "$EPOCH" ] && echo true || echo false), \"product_glued_epoch_wall_s\": ${EPOCH:-null}}"
fi

if want c; then
  el "c. flwr run on Ray's simulation engine: $NSN SuperNodes, $GPUS GPU each, 3 rounds"
  RC="zoo='$ZOO' dataset='$DS' preset='paper' device='$DEV' num-server-rounds=3 evaluate-every=3 results-dir='$WORK/ray'"
  for kv in $EXTRA; do RC="$RC ${kv%%=*}='${kv#*=}'"; done
  RC=$(echo "$RC" | sed -E "s/'([0-9]+)'/\1/g")
  timeout 240 $PY scripts/run_flwr.py --port "${PORT:-29291}" --num-supernodes $NSN --gpus-per-client $GPUS --timeout 220 --run-config "$RC" 2>&1 | grep -v "^\[flwr-sheaf\]" | tail -12
  rc=${PIPESTATUS[0]}
  $PY - "$WORK/ray/results.json" "$rc" <<'EOF' >> "$OUT/summary.jsonl" || note "{\"step\": \"c\", \"rc\": $rc, \"results\": null}"
import json, sys
r = json.load(open(sys.argv[1]))
walls = [x["wall_seconds"] for x in r["rounds"]]
print(json.dumps({"step": "c", "rc": int(sys.argv[2]), "round_wall_seconds": walls,
                  "seconds_per_epoch": (walls[1] if len(walls) > 2 else walls[-1]),
                  "final": {k: r["rounds"][-1].get(k) for k in ("private_accuracy_mean", "communication_accuracy_degree_weighted")}}))
EOF
fi

if want d; then
  [ -z "$EPOCH" ] && EPOCH=$($PY -c "import json; print(json.load(open('$OUT/floor.json'))['product']['glued_epoch']['wall_s'])" 2>/dev/null)
  EPOCH=${EPOCH:-10}; SB=${STUDY_BUDGET:-$(( $(left) - 30 ))}
  # 12 runs (s in {0.5, 0.9} x seeds {0, 1} x lambda in {0, 0.1, 1}), WORKERS processes sharing the device;
  # local epochs per round LE, rounds R = EPOCHS / LE, cut to what the budget allows (contention factor 2).
  read -r LE R <<<"$($PY -c "
e, budget, epochs, runs, w = float('$EPOCH'), float('$SB'), int('$EPOCHS'), 12, int('$WORKERS')
le = 5 if epochs >= 20 else 1
fit = int(budget * w / runs / max(e * 2.0, 1e-3))
print(le, max(1, min(epochs, fit) // le))")"
  el "d. study: Sheaf-FRL (lambda on validation from {0.1, 1}) vs lambda = 0 (strong post-hoc), $DS, preset=paper: $R rounds x $LE local epochs (asked $EPOCHS epochs; epoch ${EPOCH}s; budget ${SB}s)"
  timeout "$SB" $PY simulations/gluing_vs_posthoc.py --seeds 0 1 --shifts 0.5 0.9 --lambdas 0.1 1.0 \
    --rounds "$R" --workers $WORKERS --zoo $ZOO --extra preset=paper dataset=$DS device=$DEV local-epochs=$LE $EXTRA \
    --out "$WORK/study" 2>&1 | grep -v "^\[flwr-sheaf\]" | tail -12
  note "{\"step\": \"d\", \"rc\": ${PIPESTATUS[0]}, \"rounds\": $R, \"local_epochs\": $LE, \"epochs\": $(( R * LE )), \"asked_epochs\": $EPOCHS}"
  cp "$WORK/study/summary.json" "$OUT/study.json" 2>/dev/null
fi

if want e; then
  T=$(( $(left) - 10 )); [ -n "${SMOKE:-}" ] && T=200
  if [ "$T" -gt 30 ]; then
    el "e. k in-process runs sharing $DEV: k in {$KS} (${T}s)"
    timeout "$T" $PY benchmarks/concurrency.py --device $DEV --zoo $ZOO --dataset $DS --k $KS --timeout $(( T / 4 )) \
      --extra $EXTRA --out "$WORK/concurrency" 2>&1 | grep -v "^\[flwr-sheaf\]" | tail -8
    note "{\"step\": \"e\", \"rc\": ${PIPESTATUS[0]}}"
    cp "$WORK/concurrency/concurrency.jsonl" "$OUT/concurrency.jsonl" 2>/dev/null
  else
    el "e. skipped: ${T}s left"
  fi
fi
