#!/usr/bin/env bash
# The GPU check on a lent device machine (issue #22), which has torch with CUDA but no
# package registry: `python tools/gpu_pack.py` (or `make gpu-pack`) puts the missing
# wheels in $WHEELS (default .whl) and prints the call that carries them and the
# generated stubs. This installs the wheels into a private directory (nothing of the
# image is changed), gives the regions a tmpfs large enough for the 64 GiB
# registration when /dev/shm is smaller and we are root, and runs
# `python -m benchmarks.gpu` with the markdown under $OUT (the device tool's folder
# that comes back; bench-results here). Arguments go to benchmarks.gpu.
# PYTHON: the interpreter (default python3: the image's, with torch).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
out=${OUT:-bench-results}
if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
  echo "no wheels in $wheels: run python tools/gpu_pack.py first and carry $wheels" >&2
  exit 2
fi
if [ ! -d client/kvtierd_client/_proto ]; then
  echo "client/kvtierd_client/_proto is missing: carry it (make gen makes it)" >&2
  exit 2
fi
site=$(mktemp -d /tmp/kvtierd-site.XXXXXX)
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target "$site" "$wheels"/*.whl
export PYTHONPATH="$site:$PWD:$PWD/client" PYTHONUNBUFFERED=1

shm=/dev/shm
need_kib=$((70 * 1024 * 1024))
free_kib=$(df -Pk "$shm" | awk 'NR == 2 {print $4}')
if [ "$free_kib" -lt "$need_kib" ] && [ "$(id -u)" = 0 ] && \
   [ "$(awk '/MemTotal/ {print $2}' /proc/meminfo)" -gt $((need_kib + 32 * 1024 * 1024)) ]; then
  shm=/tmp/kvtierd-gpu-shm
  mkdir -p "$shm"
  mountpoint -q "$shm" || mount -t tmpfs -o size=72g,mode=1777 kvtierd-gpu-shm "$shm"
fi
mkdir -p "$out"
echo "python: $("$python" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())')"
echo "regions in $shm ($(df -Ph "$shm" | awk 'NR == 2 {print $4}') free)"
status=0
"$python" -m benchmarks.gpu --out "$out/gpu.md" --shm-dir "$shm" "$@" || status=$?
rm -rf "$site"  # the wheels' private install: nothing of it is kept
exit "$status"
