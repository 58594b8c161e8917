#!/usr/bin/env bash
# Sourced on the GPU machine from the project root, on a machine that a kit call left warm:
#   source .devvllm/setup.sh && <command>
# Re-enters the kit installed in /tmp/kdakit (the environment .devkit/setup.sh sets) and adds vLLM's
# Python files and the wheels beside this file (scripts/device/make-vllm.sh), installed into /tmp/kdavllm.
K=/tmp/kdakit
[ -f "$K/.ready" ] || { echo "no kit on this machine: run a call with .devkit first, then this one within ~30 s" >&2; return 1; }
if [ ! -f /tmp/kdavllm/.ready ]; then
  mkdir -p /tmp/kdavllm && tar -xJf .devvllm/vllm.tar.xz -C /tmp/kdavllm || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kdavllm .devvllm/*.whl || return 1
  touch /tmp/kdavllm/.ready
fi
source scripts/device/kit-env.sh /tmp/kdavllm
