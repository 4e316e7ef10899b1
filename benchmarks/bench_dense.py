"""Dense products of a full-graph epoch: MKL into a fresh output (torch's ``mm``), MKL into a kept
block (``mm(out=)``, what tessera's ``mkl`` path does), oneDNN into a fresh output (its
``onednn`` path), and oneDNN into a kept block through an in-place 1x1 convolution with an add
post-op (zeroed first: its ``onednn_kept`` path).

Times, on ``--threads`` threads, the GEMM shapes of a 2-layer GCN epoch on an arxiv-sized graph
(N x F_in times F_in x F_out forward, the input gradient, the weight gradient), median of
``--repeats`` after a warm-up, and prints ms and GFLOPS for each, and the path
``tessera.dense.gemm_path`` chose on this machine (run it under the allocator you train with:
``LD_PRELOAD`` jemalloc or not; under glibc a fresh output is mapped and faulted in every call).

    python benchmarks/bench_dense.py --threads 2

``--bf16`` prints instead, per product, fp32 into a kept output the way tessera computes it on this
CPU (its GEMM path; the weight gradient on MKL) against bfloat16 inputs and output two ways: torch's
oneDNN bf16 GEMM into a kept output, and float32 products over widened chunks
(``tessera.dense.widened``, what tessera runs where oneDNN has no native bfloat16 GEMM); and which
of the two tessera takes on this CPU.

    python benchmarks/bench_dense.py --threads 2 --bf16

``--chunks`` prints instead the products of the fused nodes' row chunks
(``tessera.dense.chunk_gemm``, chunks of ``tessera.dense.linear_act.CHUNK_BYTES`` of the wider
side) on each chunk library: the forward ``x W^T + b`` and input gradient ``g W`` into a kept
chunk, the weight gradient ``g^T x`` added into its accumulator, and a whole weight gradient over
every row (MKL's one product against oneDNN's sum over row chunks); and the library
``tessera.dense.gemm_path.chunk_library`` chose on this machine.

    python benchmarks/bench_dense.py --threads 2 --chunks
"""

from __future__ import annotations

import argparse

import torch
from _runner import median_s

from tessera.dense import chunk_gemm, widened
from tessera.dense.gemm_path import (
    CHUNK_LIBRARIES,
    chunk_library,
    cpu_model,
    forced_chunks,
    gemm_path,
    onednn_add_,
    onednn_product,
    onednn_usable,
)
from tessera.dense.linear import mm_into_
from tessera.dense.linear_act import CHUNK_BYTES
from tessera.threads import set_num_threads


def layer_rows(rows: int, fi: int, fo: int, repeats: int) -> None:
    """Print the table rows of one ``fi -> fo`` layer."""
    x, w, g = torch.randn(rows, fi), torch.randn(fo, fi), torch.randn(rows, fo)
    wt = w.t().contiguous()
    flops = 2.0 * rows * fi * fo
    y, gx = torch.empty(rows, fo), torch.empty(rows, fi)
    cases = {
        f"forward x W^T, {rows}x{fi} . {fi}x{fo}": (
            lambda: x.mm(w.t()),
            lambda: torch.mm(x, w.t(), out=y),
            lambda: onednn_product(x, w),
            lambda: onednn_add_(y.zero_(), x, w),
        ),
        f"input grad g W, {rows}x{fo} . {fo}x{fi}": (
            lambda: g.mm(w),
            lambda: torch.mm(g, w, out=gx),
            lambda: onednn_product(g, wt),
            lambda: onednn_add_(gx.zero_(), g, wt),
        ),
    }
    for name, fns in cases.items():
        cells = []
        for fn in fns if onednn_usable() else fns[:2]:
            t = median_s(fn, repeats)
            cells.append(f"{1e3 * t:.1f} | {flops / t / 1e9:.0f}")
        print(f"| {name} | {' | '.join(cells + ['-- | --'] * (4 - len(cells)))} |")
    t = median_s(lambda: g.t().mm(x), repeats)
    print(
        f"| weight grad g^T x (MKL), {fo}x{rows} . {rows}x{fi} | {1e3 * t:.1f} | {flops / t / 1e9:.0f} "
        "| - | - | - | - | - | - |"
    )


def bf16_rows(rows: int, fi: int, fo: int, repeats: int) -> None:
    """Print the fp32 vs bf16 rows of one ``fi -> fo`` layer, every output kept."""
    x, w, g = torch.randn(rows, fi), torch.randn(fo, fi), torch.randn(rows, fo)
    wt = w.t().contiguous()
    xb, wb, wtb, gb = x.bfloat16(), w.bfloat16(), wt.bfloat16(), g.bfloat16()
    flops = 2.0 * rows * fi * fo
    y, gx, gw = torch.empty(rows, fo), torch.empty(rows, fi), torch.empty(fo, fi)
    yb, gxb, gwb = y.bfloat16(), gx.bfloat16(), gw.bfloat16()
    cases = {
        f"forward x W^T, {rows}x{fi} . {fi}x{fo}": (
            lambda: mm_into_(y, x, w),
            lambda: torch.mm(xb, wb.t(), out=yb),
            lambda: widened.mm(xb, wb.t(), out=yb),
        ),
        f"input grad g W, {rows}x{fo} . {fo}x{fi}": (
            lambda: mm_into_(gx, g, wt),
            lambda: torch.mm(gb, wtb.t(), out=gxb),
            lambda: widened.mm(gb, wtb.t(), out=gxb),
        ),
        f"weight grad g^T x, {fo}x{rows} . {rows}x{fi}": (
            lambda: torch.mm(g.t(), x, out=gw),
            lambda: torch.mm(gb.t(), xb, out=gwb),
            lambda: widened.mm(gb.t(), xb, out=gwb),
        ),
    }
    for name, (fp32, native, wide) in cases.items():
        t32, t16 = median_s(fp32, repeats), median_s(native, repeats)
        with widened.forced_native(False):
            tw = median_s(wide, repeats)
        print(
            f"| {name} | {1e3 * t32:.1f} | {flops / t32 / 1e9:.0f} | {1e3 * t16:.1f} | {flops / t16 / 1e9:.0f} "
            f"| {1e3 * tw:.1f} | {flops / tw / 1e9:.0f} |"
        )


def chunk_rows_table(rows: int, fi: int, fo: int, repeats: int) -> None:
    """Print the chunk-product rows of one ``fi -> fo`` layer, per chunk library."""
    step = min(rows, CHUNK_BYTES // (4 * max(fi, fo)))
    x, w, b, g = torch.randn(rows, fi), torch.randn(fo, fi), torch.randn(fo), torch.randn(rows, fo)
    wt = w.t().contiguous()
    xc, gc = x[:step].contiguous(), g[:step].contiguous()
    y, gx, gw = torch.empty(step, fo), torch.empty(step, fi), torch.zeros(fo, fi)
    chunk_flops, whole_flops = 2.0 * step * fi * fo, 2.0 * rows * fi * fo
    cases = {
        f"forward chunk x W^T + b, {step}x{fi} . {fi}x{fo}": (lambda: chunk_gemm.product(y, xc, w, b), chunk_flops),
        f"input-grad chunk g W, {step}x{fo} . {fo}x{fi}": (lambda: chunk_gemm.product(gx, gc, wt), chunk_flops),
        f"weight-grad chunk g^T x, {fo}x{step} . {step}x{fi}": (
            lambda: chunk_gemm.add_weight_grad_(gw, gc, xc),
            chunk_flops,
        ),
        f"whole weight grad g^T x, {fo}x{rows} . {rows}x{fi}": (lambda: chunk_gemm.weight_grad(g, x), whole_flops),
    }
    for name, (fn, flops) in cases.items():
        cells = []
        for lib in CHUNK_LIBRARIES if onednn_usable() else CHUNK_LIBRARIES[:1]:
            with forced_chunks(lib):
                t = median_s(fn, repeats)
            cells.append(f"{1e3 * t:.2f} | {flops / t / 1e9:.0f}")
        print(f"| {name} | {' | '.join(cells + ['-- | --'] * (2 - len(cells)))} |")


def main(argv: list[str] | None = None) -> None:
    """Print the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=169_343)
    p.add_argument("--dims", type=int, nargs="+", default=[128, 256, 40], help="layer widths")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--bf16", action="store_true", help="fp32 (kept output) vs bfloat16 products instead")
    p.add_argument("--chunks", action="store_true", help="the fused nodes' row-chunk products per library instead")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    set_num_threads(a.threads)
    print(
        f"{a.rows:,} rows, widths {a.dims}, {a.threads} threads, median of {a.repeats}; CPU {cpu_model()!r}; "
        f"tessera's GEMM path here: {gemm_path()}"
    )
    print()
    if a.chunks:
        print(f"chunk library tessera takes on this CPU: {chunk_library()}")
        print()
        print("| product | MKL ms | GFLOPS | oneDNN ms | GFLOPS |")
        print("|---|---:|---:|---:|---:|")
        for fi, fo in zip(a.dims[:-1], a.dims[1:], strict=False):
            chunk_rows_table(a.rows, fi, fo, a.repeats)
        return
    if a.bf16:
        taken = "oneDNN bf16" if widened.native_bf16() else "widened"
        print(f"bfloat16 products tessera takes on this CPU: {taken}")
        print()
        print(
            f"| product | fp32 ({gemm_path()}) ms | GFLOPS | bf16 oneDNN ms | GFLOPS | bf16 widened to fp32 ms | GFLOPS |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
    else:
        print(
            "| product | MKL fresh ms | GFLOPS | MKL kept ms | GFLOPS | oneDNN fresh ms | GFLOPS "
            "| oneDNN 1x1 conv, zero + add into kept ms | GFLOPS |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for fi, fo in zip(a.dims[:-1], a.dims[1:], strict=False):
        (bf16_rows if a.bf16 else layer_rows)(a.rows, fi, fo, a.repeats)


if __name__ == "__main__":
    main()
