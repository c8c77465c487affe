"""The launch helpers' memo (kernels.triton_support.memo): cached in eager calls, traced as the plain
function under torch.compile, so compiling a model quantized by fp8now prints no dynamo warnings
about `lru_cache`-wrapped functions (it printed three, naming fp8now's files)."""

import functools
import warnings

import torch

from fp8now.kernels import triton_decode, triton_splitk
from fp8now.kernels.triton_support import memo, sm90


def lru_warnings(fn, *args):
    """(result of fn compiled with dynamo, the lru_cache warnings dynamo gave while tracing it)."""
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="eager", fullgraph=True)(*args)
    return out, [w for w in seen if "lru_cache" in str(w.message)]


def test_dynamo_warns_on_lru_cache_but_not_on_memo():
    calls = []

    def scale(k: int) -> float:
        calls.append(k)
        return 1.0 + k / 8

    cached, memoized = functools.lru_cache(maxsize=4)(scale), memo(maxsize=4)(scale)
    x = torch.randn(6, 5)
    # the control: the warning this guards against is still what dynamo does with a plain lru_cache
    y, found = lru_warnings(lambda t: t * cached(3), x)
    assert torch.equal(y, x * 1.375) and found
    y, found = lru_warnings(lambda t: t * memoized(5), x)
    assert torch.equal(y, x * 1.625) and not found
    calls.clear()
    assert [memoized(2), memoized(2), memoized(7)] == [1.25, 1.25, 1.875]
    assert calls == [2, 7]                      # eager calls are cached: the second memoized(2) is a hit
    assert memoized.cache_info().hits == 1


def test_fp8now_launch_helpers_trace_without_the_warning():
    dev = torch.device("cpu")
    x = torch.randn(4, 3)
    eager = (triton_splitk.sm_count(dev), sm90(dev), triton_decode._default_plan(16, 256, 512, dev))

    def helpers(t):
        count, hopper, plan = (triton_splitk.sm_count(t.device), sm90(t.device),
                               triton_decode._default_plan(16, 256, 512, t.device))
        return t * count + (1.0 if hopper else 0.0) + sum(plan)

    y, found = lru_warnings(helpers, x)
    assert not found
    assert torch.equal(y, x * eager[0] + (1.0 if eager[1] else 0.0) + sum(eager[2]))
