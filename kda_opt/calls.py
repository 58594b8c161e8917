"""A call of kda_forward or kda_decode as one mapping of its arguments, every one by name: the
function's signature is their one list.

    arguments_of(fn, *args, **kwargs)   a call's arguments as fn's locals() holds them (what
                                        kda_opt/plan.make_plan and make_decode_plan take)
    @traced_as(op_call)                 while torch.compile traces fn, its call is op_call(arguments):
                                        one custom op (kda_opt/op); eager calls run fn itself
The traced path binds the arguments itself, since torch.compile's tracer does not take locals() on
every torch version the package supports.
"""
import functools
import inspect

import torch


def arguments_of(function, *args, **kwargs) -> dict:
    """A call of `function` (kda_forward or kda_decode) on these arguments as the function's locals()
    holds them: every argument by name, in its signature's order, defaults filled. TypeError for
    arguments the signature does not take."""
    call = inspect.signature(function).bind(*args, **kwargs)
    call.apply_defaults()
    return call.arguments


def traced_as(op_call):
    """A decorator: the function's calls made while torch.compile traces go to op_call(arguments)
    (every argument by name, defaults filled); other calls run the function."""
    def decorate(function):
        parameters = inspect.signature(function).parameters
        names = tuple(parameters)
        defaults = {n: p.default for n, p in parameters.items() if p.default is not inspect.Parameter.empty}

        @functools.wraps(function)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op_call({**defaults, **dict(zip(names, args)), **kwargs})
            return function(*args, **kwargs)
        return call
    return decorate
