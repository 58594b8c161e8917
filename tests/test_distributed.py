"""Context parallel across processes (kda_opt/distributed). On the CPU: 2 and 3 gloo processes, each
with its slice of one sequence, or of packed sequences by their global cu_seqlens, computed by the
float64 reference (ReferenceEngine), against the reference over the whole call: the all_gather, the
merge of the slices' states and transitions, the initial states where sequences begin and the final
states where they end. With kda_opt's kernels: gloo ranks sharing one GPU, and two NCCL ranks where
two GPUs are, against one call on one GPU."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inputs import random_inputs
from kda_opt import kda_forward, reference
from kda_opt.distributed import ReferenceEngine as Reference, kda_forward_cp
from kda_opt.reference import ERROR_FLOOR
from tests.conftest import gpu, kernel_device, two_gpus

CALLS = {
    "a state": dict(initial_state=True),
    "V-first state, l2norm, beta logits": dict(initial_state=True, state_v_first=True, l2norm=True, beta_logits=True),
    "gate in kernel, GVA, K ≠ V": dict(gate="softplus", V=32, HV=4, initial_state=True),
    "no state": dict(),
}
SPLITS = {2: [130, 170], 3: [100, 77, 123]}   # slices of 300 tokens, none a multiple of 64


def inputs(call):
    """The whole sequence's arguments on the CPU, in float64, with a slow decay (a log-decay in
    (−0.02, 0] where g is the decay itself), so that each slice's start matters to its outputs."""
    args = random_inputs(1, 300, 2, 16, device="cpu", dtype=torch.float64, seed=7,
                         gate=call.get("gate", "preactivated"), **{k: v for k, v in call.items() if k != "gate"})
    if "gate" not in call:
        args["g"] = args["g"] * 0.02
    args.pop("cu_seqlens_cpu", None)
    return args


def worker(rank, world, path, args, lone):
    """Rank `rank`'s slice of `args`, which the test's process made once: inputs drawn in each rank
    differed between processes now and then (beta's fp32 logits on the CPU, by up to 3e-5). A lone
    sequence's initial state goes to rank 0 only; packed sequences' states to every rank (each takes
    those of the sequences that start on it)."""
    dist.init_process_group("gloo", init_method=f"file://{path}/pg", rank=rank, world_size=world)
    try:
        bounds = [sum(SPLITS[world][:r]) for r in range(world + 1)]
        mine = {n: x[:, bounds[rank]:bounds[rank + 1]] if n in ("q", "k", "v", "g", "beta") else x
                for n, x in args.items()}
        mine.pop("output_final_state")
        if lone and rank > 0:
            mine.pop("initial_state", None)
        o, final = kda_forward_cp(**mine, output_final_state=True, engine=Reference())
        torch.save((o, final), f"{path}/out{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("call", list(CALLS))
def test_slices_across_processes_equal_one_pass(tmp_path, world, call):
    args = inputs(CALLS[call])
    mp.spawn(worker, args=(world, str(tmp_path), args, True), nprocs=world, join=True)
    outs = [torch.load(tmp_path / f"out{r}.pt") for r in range(world)]
    ref_o, ref_s = reference.reference_forward(**args)
    o = torch.cat([x for x, _ in outs], dim=1)
    # The states cross ranks in fp32 (the all_gather, the merge's output): 1e-6 where a wrong start is
    # of order one at this decay.
    assert reference.rel_err(o, ref_o) < 1e-6
    assert reference.rel_err(outs[-1][1], ref_s) < 1e-6
    assert all(s is None for _, s in outs[:-1])


# Packed sequences over 300 tokens (global bounds, as FLA takes them): an empty one, one that crosses
# every rank boundary of both splits, one that starts on a boundary of the three-rank split (100), an
# empty one there too.
PACKED = {"across": [0, 40, 40, 200, 230, 300], "on the boundaries": [0, 100, 100, 130, 300]}


def packed_inputs(call, cu):
    """inputs(call) with the sequences packed by cu (a state per sequence where the call has one)."""
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    args = random_inputs(1, 300, 2, 16, device="cpu", dtype=torch.float64, seed=8, seqlens=lengths,
                         gate=call.get("gate", "preactivated"), **{k: v for k, v in call.items() if k != "gate"})
    if "gate" not in call:
        args["g"] = args["g"] * 0.02
    args.pop("cu_seqlens_cpu")
    return args


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("call", ["a state", "V-first state, l2norm, beta logits", "no state"])
@pytest.mark.parametrize("layout", list(PACKED))
def test_packed_slices_across_processes_equal_one_pass(tmp_path, world, call, layout):
    """Packed sequences by their global cu_seqlens, split across ranks (a sequence crossing one or two
    rank boundaries, one starting on a boundary, empty ones): o as the whole packed call's, and every
    final state from the rank where its sequence ends (the ranks' rows summed)."""
    args = packed_inputs(CALLS[call], PACKED[layout])
    mp.spawn(worker, args=(world, str(tmp_path), args, False), nprocs=world, join=True)
    outs = [torch.load(tmp_path / f"out{r}.pt") for r in range(world)]
    ref_o, ref_s = reference.reference_forward(**args)
    assert reference.rel_err(torch.cat([x for x, _ in outs], dim=1), ref_o) < 1e-6
    assert reference.rel_err(sum(s for _, s in outs), ref_s) < 1e-6


@pytest.mark.parametrize("K,V", [(64, 64), (128, 64), (128, 128)])
def test_merge_of_states_and_transitions(K, V):
    """kda_opt/merge (one Triton launch; CPU: the interpreter): S_0 = h_0, S_j = M_{j−1} S_{j−1} + h_j
    per chain (batch dimensions between the segments' and the heads'), K-first and V-first, against
    the same chain in float64; one segment is its h."""
    from kda_opt.merge import merge
    gen = torch.Generator().manual_seed(0)
    h, M = torch.randn(5, 3, 2, K, V, generator=gen), torch.randn(4, 3, 2, K, K, generator=gen) / K ** 0.5
    h, M = h.to(kernel_device()), M.to(kernel_device())
    S = reference.merge(h, M)
    assert reference.rel_err(merge(h, M), S) < 1e-5       # three tf32 products each on a GPU
    hv = h.transpose(-1, -2).contiguous()
    assert reference.rel_err(merge(hv, M, True), reference.merge(hv, M, True)) < 1e-5
    assert reference.rel_err(reference.merge(hv, M, True).transpose(-1, -2), S) < 1e-12
    assert torch.equal(merge(h[:1], M[:0]), h[:1])


def test_refuses_what_it_does_not_split(monkeypatch):
    """Host copies, pools and checkpoints are refused before any collective."""
    args = inputs(CALLS["no state"])
    args.pop("output_final_state")
    for name in ("cu_seqlens_cpu", "checkpoints", "initial_state_indices"):
        with pytest.raises(ValueError, match=name):
            kda_forward_cp(**args, **{name: torch.zeros(1)}, engine=Reference())
    with pytest.raises(ValueError, match="B = 1"):
        kda_forward_cp(**{**args, "q": torch.cat([args["q"]] * 2)}, engine=Reference())


def run_example(*flags):
    """examples/context_parallel.py under torchrun with 2 processes (on a free port): the relative
    errors it prints, the split's o and final state first."""
    import re
    import subprocess
    import sys
    root = __file__.rsplit("/tests/", 1)[0]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          f"{root}/examples/context_parallel.py", *flags], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    errors = [float(x) for x in re.findall(r"(?:o|final state) ([0-9.e+-]+)", run.stdout)]
    assert len(errors) in (2, 4), run.stdout
    return errors


@pytest.mark.parametrize("packed", [False, True])
def test_torchrun_example_on_the_cpu(packed):
    """examples/context_parallel.py --cpu (and --packed) under torchrun with 2 processes: it runs and
    prints errors far below the bound."""
    errors = run_example("--cpu", *(["--packed"] if packed else []))
    assert len(errors) == 2 and max(errors) < 1e-6


@gpu
@pytest.mark.parametrize("packed", [False, True])
def test_torchrun_example_on_gpus(packed):
    """The example with kda_opt's kernels (2 processes; on one GPU they share it through gloo): the
    split's errors against the float64 recurrence within one pass's error floor, as one call's are."""
    errors = run_example(*(["--packed"] if packed else []))
    assert len(errors) == 4 and max(errors) <= ERROR_FLOOR, errors


def rows_worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}/pg", rank=rank, world_size=world)
    try:
        from kda_bench import cp
        out = cp.cp_rank_rows(path, shapes=[(1, 300, 2)], engine=Reference(), device=torch.device("cpu"),
                              head_dim=16, dtype=torch.float64, path=f"{path}/cp.csv", rounds=1, layers=2, warmup=0)
        torch.save(out, f"{path}/rows{rank}.pt")
    finally:
        dist.destroy_process_group()


class OutOfMemoryAt(Reference):
    """The float64 engine, out of memory on rank 1 for a whole sequence of T tokens."""

    def __init__(self, T):
        self.T = T

    def forward(self, args, initial_state):
        if dist.get_rank() == 1 and args["q"].shape[1] == self.T:
            raise torch.OutOfMemoryError("a stand-in: the sequence does not fit")
        return super().forward(args, initial_state)


def skipping_worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}/pg", rank=rank, world_size=world)
    try:
        from kda_bench import cp
        out = cp.cp_rank_rows(path, shapes=[(1, 600, 2), (1, 300, 2)], configs=("default",), engine=OutOfMemoryAt(600),
                              device=torch.device("cpu"), head_dim=16, dtype=torch.float64, path=f"{path}/cp.csv",
                              rounds=1, layers=2, warmup=0)
        torch.save(out, f"{path}/rows{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_rows_that_do_not_fit_are_skipped_on_every_rank(tmp_path):
    """A row one rank cannot hold (out of memory making its inputs or running the whole sequence) is
    skipped by every rank, before any collective, and the next row is measured."""
    mp.spawn(skipping_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        rows, errors = torch.load(tmp_path / f"rows{rank}.pt")
        assert [(r["T"], r["config"]) for r in rows] == [(300, "default")] and list(errors) == [(300, 2, "default")]


def test_rows_across_ranks(tmp_path):
    """`--test cp` across ranks (kda_bench/cp.cp_rank_rows), 2 gloo processes with the float64 reference
    as the engine: a row per configuration with gpus = 2, merged into the CSV beside its one-GPU rows,
    and each rank's o and the last rank's final state those of the whole sequence in one process."""
    from kda_bench import bench, cp
    one_gpu = dict(gpus=1, B=1, T=65536, H=16, config="default", kda_opt_ms=2.5, sequential_ms=2.6, fla_ms=4.1,
                   flashkda_ms="n/a", one_gpu_ms=2.5)
    bench.write_table([one_gpu], tmp_path / "cp.csv", cp.FIELDS)
    mp.spawn(rows_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    rows, errors = torch.load(tmp_path / "rows0.pt")
    assert [(r["gpus"], r["T"], r["config"]) for r in rows] == [(2, 300, "default"), (2, 300, "flashkda")]
    assert all(isinstance(r[n], float) for r in rows for n in ("kda_opt_ms", "layers_ms", "one_gpu_ms"))
    assert all(e_o < 1e-6 and e_s < 1e-6 for e_o, e_s in errors.values()), errors
    written = bench.read_csv(tmp_path / "cp.csv")
    assert [(r["gpus"], r["T"], r["config"]) for r in written] == [(1, 65536, "default"), (2, 300, "default"),
                                                                 (2, 300, "flashkda")]


def gpu_worker(rank, world, path, backend, call, cu):
    """A rank with kda_opt's kernels on its slice: NCCL with a GPU per rank, or gloo with every rank
    on GPU 0 (one GPU: the collective through the host). cu: packed sequences' global bounds, or
    None for one sequence."""
    dist.init_process_group(backend, init_method=f"file://{path}/pg", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank if backend == "nccl" else 0)
        torch.cuda.set_device(device)
        args = gpu_inputs(call, cu, device)
        initial = args.pop("initial_state")
        bounds = [sum(GPU_SPLITS[world][:r]) for r in range(world + 1)]
        mine = {n: x[:, bounds[rank]:bounds[rank + 1]] if n in ("q", "k", "v", "g", "beta") else x
                for n, x in args.items()}
        with torch.inference_mode():
            o, final = kda_forward_cp(**mine, initial_state=initial if rank == 0 or cu else None,
                                      output_final_state=True)
        torch.save((o.cpu(), None if final is None else final.cpu()), f"{path}/out{rank}.pt")
    finally:
        dist.destroy_process_group()


GPU_SPLITS = {2: [430, 570], 3: [300, 350, 350]}   # slices of 1000 tokens
GPU_PACKED = [0, 130, 130, 800, 900, 1000]         # one crossing every boundary of both splits, an empty one


def gpu_inputs(call, cu, device):
    """1000 tokens at H = 2, K = V = 128 with a slow decay (tests/test_parallel.slow), in bf16; packed
    by cu where given (without the host copy, which kda_forward_cp does not take)."""
    from tests.test_parallel import slow
    extra = dict(l2norm=True, beta_logits=True, state_v_first=True) if call == "flashkda" else {}
    seqlens = None if cu is None else [b - a for a, b in zip(cu, cu[1:])]
    args = slow(random_inputs(1, 1000, 2, 128, seed=53, initial_state=True, device=device, seqlens=seqlens,
                              **extra))
    args.pop("output_final_state")
    args.pop("cu_seqlens_cpu", None)
    return args


def check_against_one_call(path, world, call, cu):
    """The ranks' o and final states (one sequence: the last rank's; packed: summed over the ranks)
    against one call over the whole input on GPU 0, within one pass's error floor."""
    outs = [torch.load(path / f"out{r}.pt") for r in range(world)]
    args = gpu_inputs(call, cu, torch.device("cuda", 0))
    with torch.inference_mode():
        o, s = kda_forward(**args, output_final_state=True)
    assert reference.rel_err(torch.cat([x for x, _ in outs], dim=1), o.cpu()) <= ERROR_FLOOR
    if cu is None:
        assert reference.rel_err(outs[-1][1], s.cpu()) <= ERROR_FLOOR
        assert all(f is None for _, f in outs[:-1])
    else:
        assert reference.rel_err(sum(f for _, f in outs), s.cpu()) <= ERROR_FLOOR


@gpu
@pytest.mark.parametrize("world, cu", [(2, None), (3, GPU_PACKED)], ids=["2 ranks, one sequence", "3 ranks, packed"])
@pytest.mark.parametrize("call", ["a state", "flashkda"])
def test_ranks_sharing_one_gpu_equal_one_call(tmp_path, world, cu, call):
    """2 and 3 gloo ranks on one GPU, kda_opt's kernels on each slice (forward.Prepared, one
    sequence or packed ones crossing the rank boundaries): o and the final states those of one call
    over the whole input."""
    mp.spawn(gpu_worker, args=(world, str(tmp_path), "gloo", call, cu), nprocs=world, join=True)
    check_against_one_call(tmp_path, world, call, cu)


@two_gpus
@pytest.mark.parametrize("cu", [None, GPU_PACKED], ids=["one sequence", "packed"])
@pytest.mark.parametrize("call", ["a state", "flashkda"])
def test_slices_on_two_gpus_equal_one_gpu(tmp_path, cu, call):
    """2 NCCL ranks on two GPUs, kda_opt's kernels on each (slices of 430 and 570 tokens): as on one
    GPU."""
    mp.spawn(gpu_worker, args=(2, str(tmp_path), "nccl", call, cu), nprocs=2, join=True)
    check_against_one_call(tmp_path, 2, call, cu)
