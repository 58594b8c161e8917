#!/usr/bin/env bash
# Nsight Systems profile of kda_forward and FLA chunk_kda at one shape (default: the default shape of docs/DESIGN.md).
#   bash scripts/profile.sh [--iters N] [--no-fla] [scripts/test.py shape options]
# Writes profiles/<gpu>_<shape>_kern.txt (kernel summary), _nvtx.txt (NVTX ranges) and
# _stages.txt (ms per pipeline stage, FLA's kernels beside ours, FlashKDA's per kernel where it runs the
# case), and sets that shape's table in profiles/README.md (its notes and other shapes' sections kept).
# The .nsys-rep stays in $PROFILE_TMP (default /tmp/kda_profile), out of git. Without nsys it says so
# and falls back to torch.profiler for the kernel summary (no NVTX report then).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tmp=${PROFILE_TMP:-/tmp/kda_profile}
mkdir -p "$tmp" profiles
tag=$(python3 scripts/profile_summary.py --print tag "$@")
nsys_bin=${NSYS:-$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys \
    /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1 || true)}
export KDA_OPT_NVTX=1   # kda_forward's stage ranges (kda_opt/launch), which _nvtx.txt reports
if [ -n "$nsys_bin" ] && [ -x "$nsys_bin" ]; then
  "$nsys_bin" profile -t cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop \
      -f true -o "$tmp/$tag" python3 scripts/run_profile.py "$@"
  stats() { "$nsys_bin" stats -q -f "$1" --report "$2" "$tmp/$tag.nsys-rep"; }
  stats column cuda_gpu_kern_sum > "profiles/${tag}_kern.txt"
  { stats column nvtx_sum; stats column nvtx_gpu_proj_sum 2>/dev/null || true; } > "profiles/${tag}_nvtx.txt"
  stats csv cuda_gpu_trace > "$tmp/${tag}_trace.csv"
  stats csv nvtx_pushpop_trace > "$tmp/${tag}_ranges.csv"
  python3 scripts/profile_summary.py --trace "$tmp/${tag}_trace.csv" --ranges "$tmp/${tag}_ranges.csv" \
      --source "nsys $("$nsys_bin" --version | awk '{print $NF}')" "$@"
else
  echo "profile.sh: nsys not found (PATH, \$NSYS, /opt/nvidia); falling back to torch.profiler" >&2
  python3 scripts/run_profile.py --torch-trace "$tmp/${tag}_trace.csv" "$@"
  python3 scripts/profile_summary.py --trace "$tmp/${tag}_trace.csv" --source torch.profiler \
      --kern-out "profiles/${tag}_kern.txt" "$@"
fi
echo "wrote profiles/${tag}_*.txt and profiles/README.md"
