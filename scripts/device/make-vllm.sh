#!/usr/bin/env bash
# Builds .devvllm/ in the project root: vLLM's Python files (its wheel without the compiled extensions,
# which do not load beside the GPU image's torch) as a tar.xz, and the one module the plugin's tests and
# `--test vllm` import that the GPU image lacks (pyzmq), for the lent GPU machine (Python 3.12). About
# 8 MB: it rides a SECOND call on a machine still warm from a kit call, as make-sglang.sh's kit does:
#   call 1: carry [".devkit"]   -> source .devkit/setup.sh && <anything>     (installs the kit into /tmp/kdakit)
#   call 2: carry [".devvllm"]  -> source .devvllm/setup.sh && <vllm run>    (within ~30 s of call 1's end)
# Run from the project root:   bash scripts/device/make-vllm.sh
set -euo pipefail
P=.devvllm
VLLM=${VLLM:-vllm==0.33.0}
[ -d .git ] || { echo "run me from the project root" >&2; exit 2; }
mkdir -p "$P" .git/info
grep -qx '/.devvllm/' .git/info/exclude 2>/dev/null || echo '/.devvllm/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work" "$VLLM"
python3 - "$work"/vllm-*.whl "$P/vllm.tar.xz" <<'PY'
import sys, tarfile, zipfile, io
wheel, target = zipfile.ZipFile(sys.argv[1]), sys.argv[2]
with tarfile.open(target, "w:xz") as tar:
    for info in wheel.infolist():
        if info.filename.endswith(".py") or ".dist-info/" in info.filename:
            data = wheel.read(info)
            entry = tarfile.TarInfo(info.filename)
            entry.size = len(data)
            tar.addfile(entry, io.BytesIO(data))
PY
rm -f "$P"/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$P" pyzmq
cp "$(dirname "${BASH_SOURCE[0]}")/vllm-setup.sh" "$P/setup.sh"
du -sb "$P" | awk '{printf "vllm: %.1f MB\n", $1/1e6}'
