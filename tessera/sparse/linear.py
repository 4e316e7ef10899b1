"""Dense ``x W^T + b`` for full-graph layers, with autograd, writing into workspace buffers.

torch 2.13's CPU ``mm`` goes to MKL, which picks its kernels by CPU vendor; the oneDNN kernel
behind ``torch.ops.mkldnn._linear_pointwise`` picks them by instruction set and, on an AMD
EPYC with AVX-512, ran the same full-precision fp32 products about twice as fast
(``benchmarks/bench_dense.py``; numbers in ``benchmarks/RESULTS.md``). But oneDNN's op has no
``out=``: each product is a fresh tensor that glibc maps anew and page-faults in. On an Intel CPU
MKL is as fast as oneDNN and writes into a kept :mod:`~tessera.workspace` block: on
``synthetic:arxiv`` (169 k x 128 times 128 x 256, 2 threads, Intel Xeon) 38.9 ms against oneDNN's
76.5 ms under glibc and 39.1 ms under jemalloc. So Intel CPUs use MKL into the workspace, others
oneDNN. The weight gradient (a reduction over all rows, a small output) stays on MKL. Other
devices, dtypes and torch builds without the op use ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tessera import workspace
from tessera.sparse.sparsity import sparse_rows

_LP = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
_enabled: bool | None = None


def _usable(*ts: torch.Tensor) -> bool:
    global _enabled
    if _enabled is None:
        _enabled = _probe()
    return _enabled and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 for t in ts)


def _probe() -> bool:
    # The op exists only in builds with oneDNN; check it once on a small product.
    if _LP is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        # no random numbers: drawing them would move torch's generator and so every later seed
        a, w = torch.arange(15.0).view(5, 3).sin(), torch.arange(12.0).view(4, 3).cos()
        return bool(torch.allclose(_LP(a, w, None, "none", [], ""), a @ w.t(), rtol=1e-5, atol=1e-6))
    except (RuntimeError, NotImplementedError):
        return False


def _intel() -> bool:
    """Whether the CPU is Intel's, where MKL runs its fastest kernels."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


_MKL = _intel()


def _mm_t(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ w.T + b``: into a workspace block on MKL (Intel), else a fresh oneDNN output."""
    a = a.contiguous()
    if not _MKL:
        return _LP(a, w.contiguous(), b, "none", [], "")
    out = workspace.empty((a.shape[0], w.shape[0]), a.dtype)
    return torch.mm(a, w.t(), out=out) if b is None else torch.addmm(b, a, w.t(), out=out)


def _grads(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input and weight gradients of ``x @ weight.T`` (saved as ``ctx``'s tensors) for ``g``."""
    x, weight = ctx.saved_tensors
    g = g.contiguous()
    gx = _mm_t(g, weight.t()) if ctx.needs_input_grad[1] else None
    gw = None
    if ctx.needs_input_grad[2]:
        # When most rows of g are zero (a loss on the training vertices only), the weight
        # gradient, a reduction over rows on MKL, needs only the others. The input gradient
        # stays one product: scattering its live rows into zeros measured slower.
        live = sparse_rows(g)
        if live is None:
            gw = g.t().mm(x)
        else:
            rows = torch.from_numpy(np.flatnonzero(live))
            gw = g.index_select(0, rows).t().mm(x.index_select(0, rows))
    return gx, gw


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, x, weight):
        ctx.save_for_backward(x, weight)
        return _mm_t(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        gx, gw = _grads(ctx, g)
        gb = g.sum(0) if ctx.needs_input_grad[0] else None
        return gb, gx, gw


class _LinearAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, acc, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.mark_dirty(acc)
        if _MKL:
            return acc.addmm_(x.contiguous(), weight.t())  # the GEMM accumulates: no temporary, no add pass
        return acc.add_(_mm_t(x, weight))

    @staticmethod
    def backward(ctx, g):
        return (g, *_grads(ctx, g))


def linear_add_(acc: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``acc += x @ weight.T`` in place, with autograd (``acc`` a fresh result nothing saved,
    such as a layer's aggregate: SAGE's root term then costs no N x F temporary)."""
    if _usable(x, weight) and acc.dtype == torch.float32 and acc.is_contiguous():
        return _LinearAdd.apply(acc, x, weight)
    return acc.add_(F.linear(x, weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` like ``torch.nn.functional.linear``, on oneDNN for 2-D float32 CPU inputs."""
    if _usable(x, weight):
        return _Linear.apply(bias, x, weight)
    return F.linear(x, weight, bias)
