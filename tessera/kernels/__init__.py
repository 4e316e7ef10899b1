"""Kernel support shared by several folders: the integer hash dropout and quantisation draws are
keyed by, numba vector maths, LLVM intrinsics, and dropout keyed by global ids."""
