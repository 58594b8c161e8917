"""Plans made once per call signature, for kda_forward (kda_opt/plan.plan_for) and kda_decode
(kda_opt/decode_plan.decode_plan_for): a call's signature (`signature`: everything the checks and the
plan read but the host copies' values), the Entry kept under it (the plan, its compiled kernels, its
replay) and the cache of entries (`cached`).
"""
import torch

from .fastpath import ALIGNMENT_FIXED
from .launch import Kernels

# Signatures planned, oldest first; the oldest is dropped past PLAN_CACHE_SIZE.
PLAN_CACHE_SIZE = 256
_plans: dict[tuple, "Entry"] = {}
# A signature holds a tensor argument by its metadata, any other by its value: bool, int, float or
# None (an argument of another type is planned on every call).
_OPTION_TYPES = frozenset((bool, int, float, type(None)))


class Entry:
    """A call signature's plan, the table of its compiled Triton kernels (kda_opt/launch), and the
    replay recorded from a run of it (kda_opt/replay): `replay` once made, else `not_replayed` says why
    it cannot be (None: not tried yet); `runs`: its calls run without a replay so far; `ahead`: the
    entry of its calls that run their longest sequence ahead (another run, replayed on its own; None
    until one comes)."""
    __slots__ = ("plan", "kernels", "replay", "not_replayed", "runs", "ahead")

    def __init__(self, plan):
        self.plan, self.kernels, self.replay, self.not_replayed, self.runs, self.ahead = (
            plan, Kernels(), None, None, 0, None)


def cached(key: tuple | None, make) -> tuple[Entry, bool]:
    """(Entry, whether made now): the cache's entry of `key`, or make()'s plan's, kept under `key` (the
    oldest dropped past PLAN_CACHE_SIZE; a None key is not kept)."""
    entry = None if key is None else _plans.get(key)
    if entry is not None:
        return entry, False
    entry = Entry(make())
    if key is not None:
        if len(_plans) >= PLAN_CACHE_SIZE:
            del _plans[next(iter(_plans))]
        _plans[key] = entry
    return entry, True


def signature(arguments: tuple) -> tuple | None:
    """What a plan's checks and choices read from a call, but the host copies' values: a hashable
    key, or None where an argument is of a type no signature holds (it is then planned every call,
    and the checks say what is wrong with it) or the call asks for a warning (transpose_state_layout).
    arguments: kda_forward's or kda_decode's record (kda_opt/arguments): each field a tensor's
    metadata or an option's value, in the record's order."""
    if getattr(arguments, "transpose_state_layout", None) is not None:
        return None
    grad = torch.is_grad_enabled()
    key = [grad]
    for x in arguments:
        if type(x) in _OPTION_TYPES:
            key.append(x)
        elif isinstance(x, torch.Tensor):
            # requires_grad only where grad mode is on, the one mode whose checks read it.
            key.append((x.shape, x.stride(), x.dtype, x.device, grad and x.requires_grad, x.data_ptr() % ALIGNMENT_FIXED))
        else:
            return None
    return tuple(key)
