#!/usr/bin/env bash
# One GPU session, prepared to run once within ~10 minutes (docs/devices.md, "The recorded GPU run").
# Run from the repository root on a CUDA machine whose python3 has torch; flwr and the other
# pure-Python dependencies come in the device bundle .bundle/ (and .bundle-data/ when the data
# travels in a second run; scripts/device_bundle.py, docs/devices.md "The device bundle") or as
# wheels in .whl/, and Fashion-MNIST in $FLWR_SHEAF_DATA/fashion-mnist. Everything it measures
# goes to $OUT (default results/gpu_session): the log, the GPU tests' report, per-epoch timings,
# the study slice.
#   SMOKE=1 bash benchmarks/gpu_session.sh   # the same steps, tiny, on CPU (checks the script)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-results/gpu_session}"; mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
for b in .bundle .bundle-data; do
  if [ -f "$b/manifest.json" ] && [ -z "${SMOKE:-}" ]; then
    python3 scripts/device_bundle.py install "$b" --target /tmp/site --data-dir .gpudata || exit 1
    export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
  fi
done
if [ -d .whl ] && [ -z "${SMOKE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONPATH="${PYTHONPATH:-}:$PWD"
[ -d .gpudata ] && export FLWR_SHEAF_DATA="$PWD/.gpudata"
PY="${PY:-python3}"
el "environment"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
$PY -c "import torch, flwr, flwr_sheaf; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', '| flwr', flwr.__version__); print('cpus', __import__('os').cpu_count())"
if [ -n "${SMOKE:-}" ]; then DEV=cpu; ZOO=tiny-3; EXTRA="graph=ring num-pilots=64 max-steps-per-epoch=2"; R=3; STUDY_BUDGET=40; else DEV=cuda; ZOO=paper-15; EXTRA=""; R=4; STUDY_BUDGET=${STUDY_BUDGET:-220}; fi

el "1. device tests (every method end to end on $DEV)"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_devices.py -rs --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -15

el "2. seconds per epoch, $ZOO on fashion-mnist, preset=paper, device=$DEV"
timeout 150 $PY benchmarks/epoch_time.py --device $DEV --zoo $ZOO --dataset fashion-mnist --rounds $R --extra $EXTRA --out "$OUT/epoch" | tail -40
EPOCH=$($PY -c "import json,glob; print(json.load(open(glob.glob('$OUT/epoch/epoch_time-*.json')[0]))['seconds_per_epoch'])" 2>/dev/null || echo 10)
EVAL=$($PY -c "import json,glob; r=json.load(open(glob.glob('$OUT/epoch/epoch_time-*.json')[0])); print(r['last_round_with_evaluation_seconds']-r['seconds_per_epoch'])" 2>/dev/null || echo 10)

el "3. study slice: Sheaf-FRL (lambda chosen on validation) vs lambda=0 + post-hoc, fashion-mnist, preset=paper"
# 12 runs (s in {0.5, 0.9} x seeds {0, 1} x lambda in {0, 0.1, 1}), 6 processes sharing the device;
# rounds sized from the measured epoch time so the slice fits its budget.
ROUNDS=$($PY -c "
e, v, runs, par, budget = float('$EPOCH'), float('$EVAL'), 12, 4.0, float('$STUDY_BUDGET')
r = int((budget * par / runs - v) / max(e * 1.25, 1e-3))
print(max(3, min(30, r)))")
el "rounds per run: $ROUNDS (epoch ${EPOCH}s, evaluation ${EVAL}s)"
timeout $((STUDY_BUDGET + 60)) $PY simulations/gluing_vs_posthoc.py --seeds 0 1 --shifts 0.5 0.9 --lambdas 0.1 1.0 \
  --rounds "$ROUNDS" --workers 6 --zoo $ZOO --extra preset=paper dataset=fashion-mnist device=$DEV $EXTRA \
  --out "$OUT/study" 2>&1 | grep -v "^\[flwr-sheaf\]" | tail -25

(cd "$OUT" && tar czf study.tgz study epoch 2>/dev/null && rm -rf study epoch); ls -la "$OUT"
el "done"
