"""The head dims a launch may reach: the Triton stage kernels compiled for sm_90 (Triton's own ptxas, no
GPU needed) at the smallest K and V that validation lets through (checks.SUPPORTED_HEAD_DIMS), with
the arguments their launchers pass; the interpreter does not check what only the compiler refuses (a
tl.dot's inner dimension under 16, say). The decode kernel and stage 4's cuTile kernel are compiled
there too, in tests/test_decode.py (VARIANTS) and tests/test_wuso.py (test_exports_sm90_cubin)."""
import json
import subprocess
import sys

import pytest
import torch

from kda_opt import gate, intra, merge, seqs
from kda_opt.checks import SUPPORTED_HEAD_DIMS
from kda_opt.options import GateConfig
from tests.conftest import compile_env
from tests.stage_inputs import stage_inputs

SMALLEST = min(SUPPORTED_HEAD_DIMS)
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.bool: "i1", torch.uint8: "u8"}


def launches() -> dict:
    """Each stage launcher's launches at K = V = SMALLEST (every gate mode; bf16, fp16 and fp32
    stage 2, bounded and not, packed with norms; the merge K- and V-first), recorded rather than run:
    name → (module, kernel, its parameters as JSON-able values, launch options)."""
    recorded = {}

    def record(module, name):
        def launch(fn, grid, kernels, *params, num_warps=4, num_stages=None, **args):
            values = dict(zip(fn.arg_names, params)) if params else args
            as_json = {n: {"tensor": DTYPES[x.dtype]} if isinstance(x, torch.Tensor) else getattr(x, "value", x)
                       for n, x in values.items()}    # a tl.constexpr argument as its value
            recorded[f"{name}: {fn.__name__}"] = (module.__name__, fn.__name__, as_json,
                                                   dict(num_warps=num_warps, **({} if num_stages is None else
                                                                                dict(num_stages=num_stages))))
        return launch

    K, T = SMALLEST, 130
    cu = torch.tensor([0, 1, 63, 130])
    patched = pytest.MonkeyPatch()
    try:
        patched.setattr(seqs, "triton_launch", record(seqs, "seqs"))     # the sequence tables' kernels
        for mode, config in {"safe": GateConfig(in_kernel=True, lower_bound=-5.0, safe_gate=True),
                             "softplus": GateConfig(in_kernel=True), "preactivated": GateConfig()}.items():
            patched.setattr(gate, "triton_launch", record(gate, f"gate, {mode}"))
            gate.gate_cumsum(torch.zeros(1, T, 2, K, dtype=torch.bfloat16), config, torch.zeros(2),
                             torch.zeros(2 * K))
        packed = seqs.packed(cu, T)
        seqs.longest_first(cu, T)
        seqs.ahead_layout(cu, T, 2, slots=torch.zeros(3, dtype=torch.int32),
                          has_initial_state=torch.zeros(3, dtype=torch.bool))
        for dtype, bounded, layout in ((torch.bfloat16, True, None), (torch.float16, False, None),
                                       (torch.float32, False, packed), (torch.bfloat16, False, packed)):
            x = stage_inputs(1, T, 1, K, HV=2, dtype=dtype)
            name = (f"intra, {DTYPES[dtype]}, {'bounded' if bounded else 'unbounded'}"
                    f"{', packed, norms' if layout else ''}")
            patched.setattr(intra, "triton_launch", record(intra, name))
            intra.intra_chunk(x["q"], x["k"], x["gcum"], x["beta"], K ** -0.5, gate_bounded=bounded, seqs=layout,
                              l2norm=layout is not None)
        for v_first, sms in ((False, 132), (True, None)):      # both stage counts (merge.MERGE_STAGES*)
            patched.setattr(merge, "triton_launch", record(merge, f"merge, {'V' if v_first else 'K'}-first, sms {sms}"))
            merge.merge(torch.zeros(3, 2, K, K), torch.zeros(2, 2, K, K), v_first, sms=sms)
    finally:
        patched.undo()
    return recorded


# Compiles one recorded launch (argv: module, kernel, parameters, options as JSON) for sm_90; run in a
# process of its own without TRITON_INTERPRET, where the kernels are Triton's JIT functions.
COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, values, options = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
constexprs = {p.name: values[p.name] for p in fn.params if p.is_constexpr or values[p.name] is None}
def kind(x):
    if isinstance(x, dict):
        return "*" + x["tensor"]
    if isinstance(x, bool):
        return "i1"
    return "fp32" if isinstance(x, float) else "i32" if -2 ** 31 <= x < 2 ** 31 else "i64"
signature = {p.name: "constexpr" if p.name in constexprs else kind(values[p.name]) for p in fn.params}
compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
print(len(compiled.asm["cubin"]))
"""


LAUNCHES = launches()


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_kernel_compiles_for_sm90_at_the_smallest_head_dims(name):
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(LAUNCHES[name])], env=compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and int(done.stdout.split()[-1]) > 0, done.stderr[-3000:]


def test_every_stage_kernel_is_compiled():
    """Each Triton kernel of the stage modules is among the launches compiled above."""
    compiled = {kernel for _, kernel, _, _ in LAUNCHES.values()}
    kernels = {n for module in (gate, intra, merge, seqs) for n, x in vars(module).items()
               if type(x).__name__ in ("JITFunction", "InterpretedFunction") and n.endswith("_kernel")}
    assert kernels <= compiled, kernels - compiled
