#!/usr/bin/env bash
# Installs kda_opt with its test extras and runs the test suite: the README's test command and
# what CI runs (.ci/run). Passes on a machine without a GPU: the Triton kernels then run under
# Triton's interpreter and the cuTile kernels are compiled to sm_90 cubins; GPU tests skip.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q -e ".[test]"
# cuTile's compiler, without dependencies: cuda-tile[tileiras] pins a cuda-toolkit that clashes with
# torch's (pyproject.toml says more). The versions come from the `tileiras` extra.
"$PY" -m pip install -q --no-deps $("$PY" -c '
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["tileiras"]))')
# SGLang for the plugin's tests (tests/test_sglang.py), without its dependencies: the modules its KDA
# kernel imports are in the test extra. An SGLang already installed is left as it is.
SGLANG=${SGLANG:-sglang==0.5.23}
"$PY" -c 'import sglang' 2>/dev/null || "$PY" -m pip install -q --no-deps "$SGLANG"
# vLLM for its plugin's tests (tests/test_vllm.py), the same way: its KDA functions are the oracle.
VLLM=${VLLM:-vllm==0.33.0}
"$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)' \
  || "$PY" -m pip install -q --no-deps "$VLLM"
"$PY" -c 'import torch, triton
print(f"check.sh: torch {torch.__version__} (CUDA build: {torch.backends.cuda.is_built()}, GPU: "
      f"{torch.cuda.is_available()}), triton {triton.__version__}")'
set +e
"$PY" -m pytest -q -rs "$@"
rc=$?
set -e
# pytest's 5 means no test ran: that is a failure here, not a pass.
if [ "$rc" -eq 5 ]; then echo "check.sh: no tests ran" >&2; exit 1; fi
exit "$rc"
