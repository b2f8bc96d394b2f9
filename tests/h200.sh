#!/usr/bin/env bash
# GPU tests and the H200 benchmarks in one go (the device machine has no pip index and no
# network). Writes logs, JSON and the restart plot under $OUT (default ./h200-out).
# Usage: OUT=/some/dir tests/h200.sh [tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/h200-out}"; mkdir -p "$OUT"
what="${1:-all}"
# Make `resident` importable without installing (an editable install is not always usable there).
mkdir -p /tmp/rp/resident && for d in daemon worker cli protos; do ln -sfn "$PWD/$d" "/tmp/rp/resident/$d"; done
export PYTHONPATH=/tmp/rp PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B="python3 -m resident.cli.main bench"; M=/tmp/llama3-8b-random
nvidia-smi > "$OUT/gpu_tests.txt" 2>&1
if [ "$what" != bench ]; then
  timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider tests -rs --timeout 90 --continue-on-collection-errors \
    >> "$OUT/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?" >> "$OUT/gpu_tests.txt"
fi
if [ "$what" != tests ]; then
  timeout 150 $B checkpoint $M --shape llama3-8b --force > "$OUT/checkpoint.txt" 2>&1
  timeout "${RESTART_TIMEOUT:-200}" $B restart $M --device cuda --runs "${RUNS:-1}" --json "$OUT/restart.json" \
    --plot "$OUT/restart.png" > "$OUT/restart.txt" 2>&1
  timeout "${THROUGHPUT_TIMEOUT:-120}" $B throughput $M --device cuda --batch-sizes 1,64 --context 1024 \
    --quantization none,fp8_per_tensor --json "$OUT/throughput.json" > "$OUT/throughput.txt" 2>&1
  # At most 8 files come back from the device machine: the logs travel as one archive.
  tar czf "$OUT/logs.tgz" /tmp/resident-bench-*/*.log 2>/dev/null
fi
tail -n 30 "$OUT"/*.txt
