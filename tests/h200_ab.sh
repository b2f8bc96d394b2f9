#!/usr/bin/env bash
# Same-host A/B of two trees on the GPU machine (issue 4's decode and restart figures move by ~1 %
# from host to host, so a change is only measured against the code before it, back to back).
# Here:   git archive HEAD -o build/head.tar && git archive <base> -o build/prev.tar
#         (uncommitted work: git archive $(git stash create) -o build/head.tar)
# There:  run's carry ["build/head.tar", "build/prev.tar"], command `bash tests/h200_ab.sh`
#   AB_ORDER:  the decode runs, in order (default "p h p h"; p = prev.tar, h = head.tar; "" runs none)
#   AB_QUANTS: --quantization of the decode runs (default fp8_per_tensor,none); AB_BATCHES (default 1,64)
#   AB_STEPS:  timed decode steps (default 64)
#   AB_RESTART=1: also `bench restart` (variant warm-fe, AB_RESTART_RUNS runs each, default 2) of the trees in
#      AB_RESTART_ORDER (default "p h"; e.g. "p h p h" interleaves, each invocation with its own priming start and
#      floor; restart-<n>-<tree>.json) (this part has not run yet; the decode part ran in sessions 11 and 14)
#   AB_TESTS:  GPU test paths to run on the head tree first (default none; AB_TESTS_K: a -k filter)
#   AB_PROBES: tests/gpu_decode_probes.py probes to run on the head tree after them (default none; h200.sh probes)
# Writes $OUT/ab.log, one JSON per run in $OUT/results.tgz; prints the tokens/s lines.
set -uo pipefail
OUT="${OUT:-$PWD/h200-out}"; mkdir -p "$OUT"
for t in h p; do rm -rf "/tmp/ab-$t" && mkdir -p "/tmp/ab-$t/resident"; done
tar xf build/head.tar -C /tmp/ab-h && tar xf build/prev.tar -C /tmp/ab-p ||
  { echo "build/head.tar and build/prev.tar needed" >&2; exit 2; }
for t in h p; do
  mkdir -p "/tmp/abrp-$t/resident"
  for d in daemon worker cli protos; do ln -sfn "/tmp/ab-$t/$d" "/tmp/abrp-$t/resident/$d"; done
  (cd "/tmp/ab-$t" && python3 -m compileall -q daemon worker cli protos > /dev/null 2>&1)
done
cd /tmp/ab-h
if [ -n "${AB_TESTS:-}" ]; then
  GPU_TESTS="$AB_TESTS" GPU_TESTS_K="${AB_TESTS_K:-}" OUT="$OUT" bash tests/h200.sh gputests > /dev/null 2>&1
  grep -E "passed|failed" "$OUT/log.txt" | tail -2
fi
if [ -n "${AB_PROBES:-}" ]; then
  PROBES="$AB_PROBES" OUT="$OUT" bash tests/h200.sh probes > /dev/null 2>&1
  grep -E "^probe " "$OUT/log.txt"
  mv "$OUT/results.tgz" "$OUT/probes.tgz" 2>/dev/null   # (h200.sh packs its JSON there; results.tgz is the A/B's)
fi
OUT="$OUT" bash tests/h200.sh checkpoint > /dev/null 2>&1   # the Llama-3-8B-shaped checkpoint in /tmp/llama3-8b-random
i=0
for t in ${AB_ORDER-p h p h}; do
  i=$((i + 1))
  (cd "/tmp/ab-$t" && PYTHONPATH="/tmp/abrp-$t" timeout 150 python3 -m resident.cli.main bench throughput \
     /tmp/llama3-8b-random --device cuda --batch-sizes "${AB_BATCHES:-1,64}" --context 1024 \
     --quantization "${AB_QUANTS:-fp8_per_tensor,none}" --steps "${AB_STEPS:-64}" --json "$OUT/tp-$i-$t.json" \
     >> "$OUT/ab.log" 2>&1)
  echo "run $i tree $t rc=$?" >> "$OUT/ab.log"
done
if [ "${AB_RESTART:-0}" = 1 ]; then
  n=0
  for t in ${AB_RESTART_ORDER:-p h}; do
    n=$((n + 1))
    (cd "/tmp/ab-$t" && PYTHONPATH="/tmp/abrp-$t" RESIDENT_BENCH_LOGS=/tmp/bench-logs-$t timeout 300 \
       python3 -m resident.cli.main bench restart /tmp/llama3-8b-random --device cuda --runs "${AB_RESTART_RUNS:-2}" \
       --variants warm-fe --json "$OUT/restart-$n-$t.json" >> "$OUT/ab.log" 2>&1)
    echo "restart $n tree $t rc=$?" >> "$OUT/ab.log"
  done
fi
(cd "$OUT" && tar czf results.tgz ./*.json && rm -f ./*.json)
grep -E "tokens/s|rc=|ready - floor" "$OUT/ab.log" | cut -c1-220
