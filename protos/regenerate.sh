#!/usr/bin/env bash
# Regenerate the committed *_pb2*.py files from protos/**/*.proto.
#
# Pinned generator: grpcio-tools 1.84.0. Newer grpcio-tools stamps a higher minimum grpcio
# into *_pb2_grpc.py, which then refuses to import on grpcio 1.84 (the H200 machine).
# The .proto files are copied into a temporary tree under resident/protos/ so protoc
# writes imports as `from resident.protos.resident.v1 import ...`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python3 -c 'import grpc_tools, importlib.metadata as m; v = m.version("grpcio-tools"); assert v == "1.84.0", f"need grpcio-tools==1.84.0, have {v}: pip install grpcio-tools==1.84.0"'
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/resident/protos"
(cd "$here" && find . -name '*.proto' -exec cp --parents {} "$tmp/resident/protos/" \;)
protos=$(cd "$tmp" && find resident -name '*.proto' | sort)
(cd "$tmp" && python3 -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. $protos)
for p in $protos; do
  d="$(dirname "${p#resident/protos/}")"
  cp "$tmp/$(dirname "$p")"/*_pb2*.py* "$here/$d/"
done
# Messages-only protos get an empty *_pb2_grpc.py; drop those.
grep -L "^class " $(find "$here" -name "*_pb2_grpc.py") | xargs -r rm -f
echo "regenerated: $protos"
