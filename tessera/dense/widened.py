"""Dense products of bfloat16 operands: oneDNN's bfloat16 GEMM where this CPU runs it natively,
else float32 products over widened chunks.

``--precision bf16`` stores activations in bfloat16 and multiplies with float32 accumulation. With
AVX-512 (BF16 or its emulation) oneDNN's bfloat16 GEMM does exactly that at full speed; on a CPU
with AVX2 only it falls back to a kernel many times slower than the float32 GEMM
(``docs/design/gemm-library-path.md``). There, each product here widens a few megabytes of rows at a
time to float32 (exact: a bfloat16 is a float32's high half), multiplies them on the float32 GEMM
and rounds each result once, as the native kernel does, at about float32's speed; the operands stay
bfloat16 in memory and no block larger than a chunk is widened. Other dtypes go straight to ``torch``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tessera import workspace
from tessera.bfloat16 import BF16
from tessera.dense.gemm_path import native_bf16_gemm
from tessera.memo import tuning

# float32 bytes of a widened chunk: a few megabytes stay in L2/L3 between widening and product
CHUNK_BYTES = 2 << 20


def native_bf16() -> bool:
    """Whether bfloat16 products go to oneDNN's bfloat16 GEMM (:func:`~tessera.dense.gemm_path.native_bf16_gemm`)."""
    forced = tuning.forced_native_bf16
    return native_bf16_gemm() if forced is None else forced


@contextmanager
def forced_native(native: bool) -> Iterator[None]:
    """Within this block, :func:`native_bf16` answers ``native`` (tests)."""
    with tuning.forcing("forced_native_bf16", native):
        yield


def _widen(t: torch.Tensor) -> bool:
    return t.dtype == BF16 and t.device.type == "cpu" and not native_bf16()


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (into ``out`` when given), as ``torch.mm``."""
    if not _widen(a):
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    return _product(out, a, b, None, False)


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = bias + a @ b``, as ``torch.addmm(bias, a, b, out=out)``."""
    if not _widen(a):
        return torch.addmm(bias, a, b, out=out)
    return _product(out, a, b, bias, False)


def addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in place, as ``acc.addmm_(a, b)``."""
    if not _widen(a):
        return acc.addmm_(a, b)
    return _product(acc, a, b, None, True)


def _product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, add: bool) -> torch.Tensor:
    m, k = a.shape
    if m >= k:
        # a tall operand (a layer's rows): each chunk of rows widened, multiplied by the widened
        # (small) b, its result rounded once into out's rows
        bf = b.float()
        biasf = None if bias is None else bias.float()
        step = workspace.chunk_rows(max(k, b.shape[1]), 4, m, CHUNK_BYTES)
        for r0 in range(0, m, step):
            r1 = min(m, r0 + step)
            z = out[r0:r1].float() if add else None
            if z is not None:
                z.addmm_(a[r0:r1].float(), bf)
            elif biasf is not None:
                z = torch.addmm(biasf, a[r0:r1].float(), bf)
            else:
                z = torch.mm(a[r0:r1].float(), bf)
            out[r0:r1].copy_(z)
        return out
    # a reduction over many rows (a weight gradient g^T x): float32 partial sums over chunks of
    # the shared dimension, rounded once at the end
    acc = out.float() if add else torch.zeros(out.shape, dtype=torch.float32)
    if bias is not None:
        acc.add_(bias.float())
    step = workspace.chunk_rows(m + b.shape[1], 4, k, CHUNK_BYTES)
    for c0 in range(0, k, step):
        c1 = min(k, c0 + step)
        acc.addmm_(a[:, c0:c1].float(), b[c0:c1].float())
    return out.copy_(acc)
