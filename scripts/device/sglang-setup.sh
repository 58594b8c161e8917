#!/usr/bin/env bash
# Sourced on the GPU machine from the project root, on a machine that a kit call left warm:
#   source .devsglang/setup.sh && <command>
# Re-enters the kit installed in /tmp/kdakit (the environment .devkit/setup.sh sets) and adds the wheels
# beside this file (scripts/device/make-sglang.sh), installed into /tmp/kdasglang.
K=/tmp/kdakit
[ -f "$K/.ready" ] || { echo "no kit on this machine: run a call with .devkit first, then this one within ~30 s" >&2; return 1; }
if [ ! -f /tmp/kdasglang/.ready ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kdasglang .devsglang/*.whl || return 1
  touch /tmp/kdasglang/.ready
fi
source scripts/device/kit-env.sh /tmp/kdasglang
