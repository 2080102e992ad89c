#!/usr/bin/env bash
# GPU check: run on a machine with a CUDA GPU, from the repository root.
#
#   scripts/gpu_check.sh                 # everything below, results in runs/gpu_check/
#   STEPS=60 DATA=path/to/text.txt scripts/gpu_check.sh
#   ALLOW_CPU=1 DEVICE=cpu STEPS=4 scripts/gpu_check.sh   # plumbing check on a CPU-only machine
#
# 1. the device tests on the real GPU: tests/test_device.py with IOTA_TEST_DEVICE=cuda (merging,
#    state sync, stage workers and checkpoints with the stage on the GPU; the
#    CUDA-only tests: pinned non-blocking copies on a side stream, fused AdamW, the activation cache
#    measured by torch.cuda.memory_allocated, the chunked cross-entropy's peak memory), plus the
#    model and stage-worker tests;
# 2. a 2-stage x 2-replica localnet on `small` with merging (every 10 inner steps), miners on the GPU;
# 3. scripts/bench_model.py: tokens/s and MFU against the GPU's bf16 peak (and the measured matmul peak).
#
# Exit status: 0 when every step passed, 1 when one failed (the summary says which), 2 without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
STEPS=${STEPS:-40}
DEVICE=${DEVICE:-cuda}
DATA=${DATA:-$( [ -f ../shared/data/wikitext-2/wiki.valid.raw.txt ] && echo ../shared/data/wikitext-2/wiki.valid.raw.txt || echo stdlib://python )}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

if [ ! -x "$PY" ]; then
  make setup TORCH_SPEC="${TORCH_SPEC:-torch}" || { echo "gpu_check: make setup failed" >&2; exit 2; }
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if [ "${ALLOW_CPU:-0}" != "1" ]; then
    echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)'))." >&2
    echo "  On a GPU host install a CUDA build: make setup TORCH_SPEC=torch (after rm -rf .venv)." >&2
    exit 2
  fi
  echo "gpu_check: no GPU; ALLOW_CPU=1: checking the plumbing on $DEVICE" >&2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.csv"

status=0
declare -A RESULT

# 1. device tests on the real device
if [ "$DEVICE" = "cuda" ]; then export IOTA_TEST_DEVICE=cuda; fi
if "$PY" -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_model.py tests/test_stage_worker.py \
     --junitxml="$OUT/device_tests.xml" 2>&1 | tee "$OUT/device_tests.log" | tail -5; [ "${PIPESTATUS[0]}" -eq 0 ]; then
  RESULT[device_tests]=passed
else
  RESULT[device_tests]=FAILED; status=1
fi
unset IOTA_TEST_DEVICE

# 2. a 2-stage localnet on small, 2 replicas per stage, merging every 10 inner steps, miners on the device
rm -rf "$OUT/localnet"
if timeout 1800 "$PY" -m iota_subnet.cli localnet --stages 2 --replicas 2 --validators 1 --config configs/small.yaml \
     --data "$DATA" --steps "$STEPS" --device "$DEVICE" --set merge.every_steps=10 --out "$OUT/localnet" \
     > "$OUT/localnet.log" 2>&1; then
  RESULT[localnet]=passed
else
  RESULT[localnet]=FAILED; status=1
fi
tail -3 "$OUT/localnet.log"

# 3. throughput and MFU against the GPU's bf16 peak
if "$PY" scripts/bench_model.py --config configs/small.yaml --data "$DATA" --steps "$STEPS" --ratios 1,8 \
     --eval-batches 2 --device "$DEVICE" --json > "$OUT/bench_model.json" 2> "$OUT/bench_model.log"; then
  RESULT[bench_model]=passed
else
  RESULT[bench_model]=FAILED; status=1
fi

"$PY" - "$OUT" "${RESULT[device_tests]}" "${RESULT[localnet]}" "${RESULT[bench_model]}" <<'EOF'
import json, sys
from pathlib import Path
out, dev, ln, bm = Path(sys.argv[1]), *sys.argv[2:5]
summary = {"device_tests": dev, "localnet": ln, "bench_model": bm}
s = out / "localnet" / "summary.json"
if s.exists():
    d = json.loads(s.read_text())
    summary["localnet_summary"] = {k: d.get(k) for k in ("val_loss", "final_loss", "tokens_per_s", "merge")}
b = out / "bench_model.json"
if b.exists() and b.stat().st_size:
    d = json.loads(b.read_text())
    summary["bench_model"] = {k: d.get(k) for k in ("gpu", "device", "tokens_per_s", "matmul_peak_flops",
                                                    "gpu_bf16_peak_flops", "mfu_measured_peak")}
    summary["bench_model"]["mfu_gpu_bf16_peak"] = [(r["ratio"], r["mfu_gpu_bf16_peak"]) for r in d.get("ratios", [])]
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
EOF
exit $status
