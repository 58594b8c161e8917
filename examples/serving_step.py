"""One prefill step of a serving engine's KDA layer on kda_opt, as vLLM and SGLang schedule it.

A state pool holds one [HV, V, K] fp32 state per slot (V-first, as both engines lay it out). A step
packs new requests and continuations of unequal lengths into one call: each reads its slot's state
(new ones start from zeros: has_initial_state False), its final state is written back into the same
slot in place, and the state after every 64-token chunk lands in a checkpoint buffer for the prefix
cache. Nothing is gathered or scattered around the call, nothing waits on the host, so the step runs
the same under torch.compile(fullgraph=True) and inside a CUDA graph.

    python examples/serving_step.py      (a Hopper GPU: compute capability 9.0)

checks each request against running it alone from its state, then the compiled step and a CUDA
graph replay against the eager one, and prints what it compared.
"""
import torch

from kda_opt import kda_forward

H, K = 4, 128                     # heads; K = V, as Kimi-Linear's layer
SLOTS = 12                        # pool rows
LOWER_BOUND = -5.0                # Kimi's bounded gate; None: the softplus gate
# (slot, tokens this step, continues an earlier request)
REQUESTS = [(3, 200, True), (7, 64, False), (0, 1, True), (10, 517, False), (5, 90, True)]


def prefill(pool, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, slots, has_state, checkpoints):
    """The layer's call: raw gate, beta logits, q/k l2norm in kernel; pool [SLOTS, H, V, K] read
    and written at `slots`; checkpoints [1, rows, H, V, K] written after every chunk. Returns o."""
    o, _ = kda_forward(q, k, v, g, beta, initial_state=pool, initial_state_indices=slots,
                       has_initial_state=has_state, checkpoints=checkpoints, use_qk_l2norm_in_kernel=True,
                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                       safe_gate=LOWER_BOUND is not None, lower_bound=LOWER_BOUND, state_v_first=True,
                       cu_seqlens=cu_seqlens)
    return o


def make_step(requests=REQUESTS, seed=0, device="cuda"):
    """prefill's arguments for one step of `requests`: random activations, a pool of random states."""
    gen = torch.Generator().manual_seed(seed)
    lens = [n for _, n, _ in requests]
    T = sum(lens)
    x = lambda *shape: torch.randn(*shape, generator=gen).to(device, torch.bfloat16)
    return dict(
        pool=torch.randn(SLOTS, H, K, K, generator=gen).to(device),
        q=x(1, T, H, K), k=x(1, T, H, K), v=x(1, T, H, K), g=x(1, T, H, K), beta=x(1, T, H),
        A_log=torch.empty(H).uniform_(1, 16, generator=gen).log().to(device),
        dt_bias=torch.randn(H * K, generator=gen).to(device),
        cu_seqlens=torch.tensor([0, *lens], device=device).cumsum(0),
        slots=torch.tensor([s for s, _, _ in requests], device=device),
        has_state=torch.tensor([c for _, _, c in requests], device=device),
        # Σ cdiv(len, 64) rows: the chunks of every request, in request order.
        checkpoints=torch.zeros(1, sum(-(-n // 64) for n in lens), H, K, K, device=device),
    )


def alone(step, n, requests=REQUESTS):
    """Request n run by itself from its slot's state (zeros when new): (o, final state, checkpoints)."""
    lens = [t for _, t, _ in requests]
    a, b = sum(lens[:n]), sum(lens[:n + 1])
    slot, _, continues = requests[n]
    state = step["pool"][slot:slot + 1] * continues
    ck = torch.zeros(1, -(-lens[n] // 64), H, K, K, device=state.device)
    cut = lambda name: step[name][:, a:b]
    o, final = kda_forward(cut("q"), cut("k"), cut("v"), cut("g"), cut("beta"), initial_state=state,
                           output_final_state=True, checkpoints=ck, use_qk_l2norm_in_kernel=True,
                           use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=step["A_log"],
                           dt_bias=step["dt_bias"], safe_gate=LOWER_BOUND is not None, lower_bound=LOWER_BOUND,
                           state_v_first=True)
    return o, final, ck


def fresh(step):
    """A copy of the step's arguments whose pool and checkpoint buffer are its own."""
    return {**step, "pool": step["pool"].clone(), "checkpoints": step["checkpoints"].clone()}


def worst_difference(step, requests=REQUESTS):
    """Runs the step eagerly and returns the largest relative difference, over requests, of o, the
    pool row and the checkpoints from running the request alone."""
    done = fresh(step)
    o = prefill(**done)
    lens = [t for _, t, _ in requests]
    worst, row = 0.0, 0
    rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()
    for n, (slot, t, _) in enumerate(requests):
        o_n, final_n, ck_n = alone(step, n, requests)
        a = sum(lens[:n])
        chunks = ck_n.shape[1]
        worst = max(worst, rel(o[:, a:a + t], o_n), rel(done["pool"][slot], final_n[0]),
                    rel(done["checkpoints"][:, row:row + chunks], ck_n))
        row += chunks
    return worst


def compiled_and_graphed(step):
    """(eager, compiled, graph-replayed) results of the same step: each (o, pool, checkpoints)."""
    results = []
    eager = fresh(step)
    results.append((prefill(**eager), eager["pool"], eager["checkpoints"]))
    compiled = fresh(step)
    results.append((torch.compile(prefill, fullgraph=True)(**compiled), compiled["pool"], compiled["checkpoints"]))
    static = fresh(step)
    warm = fresh(step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prefill(**warm)                    # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = prefill(**static)
    graph.replay()                         # (capturing records the kernels; it runs none)
    results.append((o, static["pool"], static["checkpoints"]))
    return results


def main():
    step = make_step()
    print(f"requests (slot, tokens, continues): {REQUESTS}")
    print(f"each request against running it alone: worst relative difference {worst_difference(step):.1e}")
    (o, pool, ck), *others = compiled_and_graphed(step)
    for name, (o2, pool2, ck2) in zip(("torch.compile(fullgraph=True)", "CUDA graph replay"), others):
        same = torch.equal(o, o2) and torch.equal(pool, pool2) and torch.equal(ck, ck2)
        print(f"{name}: o, pool and checkpoints {'equal to eager, bit for bit' if same else 'DIFFER from eager'}")


if __name__ == "__main__":
    main()
