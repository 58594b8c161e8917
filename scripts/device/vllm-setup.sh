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
export PYTHONPATH="$PWD:$PWD/scripts:/tmp/kdavllm:$K/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$K/tc/nvidia/cu13/bin:$PATH" PYTHONUNBUFFERED=1 FLA_FLASH_KDA=${FLA_FLASH_KDA:-0}
unset CUDA_HOME CUDA_PATH
export LD_LIBRARY_PATH="$K/libdw/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# kda_opt runs from the tree, not installed: its entry points (pyproject.toml) as the metadata an install
# would write, so that vLLM's load_general_plugins finds the plugin.
python3 - <<'PY'
import os, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
info = f"/tmp/kdavllm/kda_opt-{project['version']}.dist-info"
os.makedirs(info, exist_ok=True)
open(f"{info}/METADATA", "w").write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
open(f"{info}/entry_points.txt", "w").write("".join(
    f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items())
    for group, points in project["entry-points"].items()))
PY
