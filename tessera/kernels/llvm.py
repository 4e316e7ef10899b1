"""LLVM intrinsics emitted from numba code generation, declared in one place."""

from __future__ import annotations

from llvmlite import ir

_I32 = ir.IntType(32)


def call_intrinsic(builder: ir.IRBuilder, name: str, ret: ir.Type, *args: ir.Value) -> ir.Instruction:
    """A call of the LLVM intrinsic ``name`` on ``args``, declared in the module on first use."""
    fn = builder.module.globals.get(name) or ir.Function(
        builder.module, ir.FunctionType(ret, [a.type for a in args]), name
    )
    return builder.call(fn, list(args))


def prefetch(builder: ir.IRBuilder, ptr: ir.Value) -> None:
    """``llvm.prefetch`` of the cache line at ``ptr``: a read, kept in every cache level, of data."""
    byte_ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
    read, keep, data = ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)
    call_intrinsic(builder, "llvm.prefetch.p0", ir.VoidType(), byte_ptr, read, keep, data)
