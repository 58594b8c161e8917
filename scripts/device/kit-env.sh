#!/usr/bin/env bash
# Sourced from the project root by an engine kit's setup.sh (scripts/device/sglang-setup.sh, vllm-setup.sh)
# once its files are installed into the folder $1, on a machine a kit call left warm: re-enters the kit in
# /tmp/kdakit (the environment .devkit/setup.sh sets), puts the tree, scripts/ and $1 on PYTHONPATH, and
# writes into $1 kda_opt's entry points (pyproject.toml) as the metadata an install would write: kda_opt
# runs from the tree, not installed, and the engines find their plugins through that metadata.
K=/tmp/kdakit
export PYTHONPATH="$PWD:$PWD/scripts:$1:$K/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$K/tc/nvidia/cu13/bin:$PATH" PYTHONUNBUFFERED=1 FLA_FLASH_KDA=${FLA_FLASH_KDA:-0}
unset CUDA_HOME CUDA_PATH
export LD_LIBRARY_PATH="$K/libdw/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
python3 - "$1" <<'PY'
import os, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
info = f"{sys.argv[1]}/kda_opt-{project['version']}.dist-info"
os.makedirs(info, exist_ok=True)
open(f"{info}/METADATA", "w").write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
open(f"{info}/entry_points.txt", "w").write("".join(
    f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items())
    for group, points in project["entry-points"].items()))
PY
