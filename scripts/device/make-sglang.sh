#!/usr/bin/env bash
# Builds .devsglang/ in the project root: SGLang's wheel (cp312, --no-deps) and the modules its KDA
# kernels' import chain needs that the GPU image lacks, for the SGLang tests and `--test sglang` on the
# lent GPU machine (Python 3.12, torch and triton preinstalled). About 53 MB: it rides a SECOND call on
# a machine still warm from a kit call, as ../shared/device/make-peers.sh's peers do:
#   call 1: carry [".devkit"]    -> source .devkit/setup.sh && <anything>      (installs the kit into /tmp/kdakit)
#   call 2: carry [".devsglang"] -> source .devsglang/setup.sh && <sglang run> (within ~30 s of call 1's end)
# Run from the project root:   bash scripts/device/make-sglang.sh
set -euo pipefail
P=.devsglang
SGLANG=${SGLANG:-sglang==0.5.23}
[ -d .git ] || { echo "run me from the project root" >&2; exit 2; }
mkdir -p "$P" .git/info
grep -qx '/.devsglang/' .git/info/exclude 2>/dev/null || echo '/.devsglang/' >> .git/info/exclude
rm -f "$P"/*.whl
pipdl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$P" "$@"
}
# SGLang itself, then what `sglang.srt.layers.attention.linear.kernels.kda_triton` and
# `sglang.srt.plugins` import that the image (KINDS.md's package list) does not hold: found by importing
# them in a fresh environment with sglang installed --no-deps, one missing module at a time.
pipdl "$SGLANG"
pipdl orjson pybase64 starlette msgspec pydantic pydantic-core annotated-types typing-inspection pyzmq \
  ipython ipython-pygments-lexers jedi parso traitlets prompt-toolkit decorator matplotlib-inline pexpect \
  ptyprocess stack-data executing asttokens pure-eval wcwidth
# The JIT CUDA kernels' loader (SGLang's packed decode from 8 requests builds its row-streaming kernel
# through it with the image's nvcc): the version SGLang's own metadata pins.
pipdl "apache-tvm-ffi==$(python3 - "$P"/sglang-*.whl <<'PY'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
print(next(line.split("==")[1].strip() for line in wheel.read(meta).decode().splitlines()
           if line.startswith("Requires-Dist: apache-tvm-ffi==")))
PY
)"
# SGLang's Helion KDA backend (`--linear-attn-{prefill,decode}-backend helion`, kda_helion.py): the
# version its own error message asks for (its configs are tuned on it); Helion's imports are otherwise
# on the image, filecheck its one declared dependency that is not.
pipdl "helion==${HELION_VERSION:-1.4.0}" filecheck
cp "$(dirname "${BASH_SOURCE[0]}")/sglang-setup.sh" "$P/setup.sh"
du -sb "$P" | awk '{printf "sglang: %.1f MB\n", $1/1e6}'
