"""The serving step timed (`--sweep --sweep-rows step`, docs/BENCHMARKING.md): one packed prefill call with a state
pool, as an engine makes it, by each system the way it can make it.

    kda_opt          the pool read and written in place (initial_state_indices, has_initial_state)
    kda_opt dense    the same call on the states already gathered: what the pool costs over it
    kda_opt ckpt     the pool call writing the state after every chunk (fp32) for prefix caching
    FLA, FlashKDA    gather the rows (new requests' zeroed), call, scatter the final states back,
                     as vLLM does around chunk_kda and flash_kda.fwd
The call is Kimi-Linear's: raw gate with A_log / dt_bias, beta logits, q/k l2norm in kernel, a
V-first fp32 pool [slots, H, V, K] (CONFIGS["serving"]); every third request is new.
"""
import torch

from . import peers


def pool_of(args, seed):
    """A pool of 2N + 1 random rows holding the case's N initial states at shuffled slots, the slots
    (int64) and has_initial_state (every third request new)."""
    states = args["initial_state"]
    N = states.shape[0]
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2 * N + 1, *states.shape[1:], generator=gen).to(states.device)
    slots = torch.randperm(2 * N + 1, generator=gen)[:N].to(states.device)
    pool[slots] = states
    has_state = torch.arange(N, device=states.device) % 3 != 2
    return pool, slots, has_state


def checkpoint_buffer(states, B, T, N, every=64):
    """An fp32 checkpoint buffer in the row layout of `states` (a pool or initial states [·, HV, ...])
    with a checkpoint every `every` tokens: [B, cdiv(T, every), HV, ...] for B sequences of T tokens,
    or for N packed into one (B = 1) the cdiv(T, every) + N − 1 rows that always suffice
    (kda_forward's docstring)."""
    rows = -(-T // every) + (N - 1 if B == 1 else 0)
    return torch.empty(B, rows, *states.shape[1:], dtype=torch.float32, device=states.device)


def step_runs(args, fla, kda_forward, seed=0):
    """({system: step()}, why FlashKDA does not run or None) for the serving step on kda_forward's
    keyword arguments `args` (which hold the dense initial states)."""
    pool, slots, has_state = pool_of(args, seed)
    N, T = slots.shape[0], args["q"].shape[1]
    gathered = torch.empty_like(args["initial_state"])
    dense = {**args, "initial_state": gathered, "output_final_state": True}
    pooled = {**args, "initial_state": pool, "initial_state_indices": slots, "has_initial_state": has_state,
              "output_final_state": False}
    checkpoints = checkpoint_buffer(pool, 1, T, N)
    zeroed = ~has_state[:, None, None, None]

    def gather():
        torch.index_select(pool, 0, slots, out=gathered)
        gathered.masked_fill_(zeroed, 0.0)

    def around(call):
        def step():
            gather()
            final = call()[1]
            pool.index_copy_(0, slots, final.to(pool.dtype))
        return step

    gather()
    runs = {"kda_opt": lambda: kda_forward(**pooled), "kda_opt_dense": lambda: kda_forward(**dense),
            "kda_opt_ckpt": lambda: kda_forward(**pooled, checkpoints=checkpoints),
            "fla": around(lambda: fla(**dense))}
    flashkda, why_not = peers.flashkda(dense)
    if flashkda:
        runs["flashkda"] = around(flashkda)
    return runs, why_not
