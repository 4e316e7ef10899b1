"""The LSTM recurrence's elementwise steps: one step's cell update and gate gradients, each in
one pass, as numba kernels over NumPy views of CPU tensors and as torch ops for any device."""

from __future__ import annotations

import numba
import numpy as np
import torch

# One step's cell update and gate gradients in torch ops, for tensors off the CPU (and
# ``--backend torch``).


def cell_state_torch(gates, cs, a, prev, b):
    """:func:`cell_state` in torch ops."""
    hid = cs.shape[1]
    c = gates[a : a + b, :hid] * gates[a : a + b, 3 * hid :]
    if prev >= 0:
        c += gates[a : a + b, hid : 2 * hid] * cs[prev : prev + b]
    cs[a : a + b] = c


def cell_output_torch(gates, tc, hs, out, a, nxt, b, nb):
    """:func:`cell_output` in torch ops."""
    hid = tc.shape[1]
    h = gates[a : a + b, 2 * hid : 3 * hid] * tc[:b]
    hs[nxt : nxt + nb] = h[:nb]
    out[nb:b] = h[nb:]


def cell_backward_torch(gates, cs, tc, dgates, dh, dc, dout, a, prev, b, nb):
    """:func:`cell_backward` in torch ops."""
    hid = cs.shape[1]
    g4 = gates[a : a + b]
    i, f, o, g = g4[:, :hid], g4[:, hid : 2 * hid], g4[:, 2 * hid : 3 * hid], g4[:, 3 * hid :]
    t = tc[:b]
    h_grad = torch.cat([dh[:nb], dout[nb:b]])
    carried = torch.cat([dc[:nb], dc.new_zeros(b - nb, hid)])
    c_grad = carried + h_grad * o * (1.0 - t * t)
    d = dgates[a : a + b]
    d[:, :hid] = c_grad * g * i * (1.0 - i)
    if prev >= 0:
        d[:, hid : 2 * hid] = c_grad * cs[prev : prev + b] * f * (1.0 - f)
    else:
        d[:, hid : 2 * hid] = 0.0
    d[:, 2 * hid : 3 * hid] = h_grad * t * o * (1.0 - o)
    d[:, 3 * hid :] = c_grad * i * (1.0 - g * g)
    dc[:b] = c_grad * f


# The host recurrence's fused kernels: one call per step does the whole cell (gates' nonlinearities,
# c, tanh(c), h) or its whole gradient, with tanh as a rational function evaluated in float64
# (vectorised by LLVM, max error 7e-8 against float64 tanh; torch's float32 tanh is ~6x slower
# than its sigmoid here). error_model="numpy" drops the division-by-zero check that stops LLVM
# vectorising the division.

_CLAMP = 9.0  # |tanh(x) - 1| < 3e-8 (below float32's half ulp at 1) beyond this


@numba.njit(fastmath=True, inline="always", error_model="numpy")
def _tanh(x):
    """tanh of a float32 as float64 (Eigen's rational tanh; 3.5e-8 from tanh on [-9, 9])."""
    x = min(max(np.float64(x), -_CLAMP), _CLAMP)
    x2 = x * x
    p = -2.76076847742355e-16 * x2 + 2.00018790482477e-13
    p = p * x2 - 8.60467152213735e-11
    p = p * x2 + 5.12229709037114e-08
    p = p * x2 + 1.48572235717979e-05
    p = p * x2 + 6.37261928875436e-04
    p = p * x2 + 4.89352455891786e-03
    q = 1.19825839466702e-06 * x2 + 1.18534705686654e-04
    q = q * x2 + 2.26843463243900e-03
    q = q * x2 + 4.89352518554385e-03
    return p * x / q


@numba.njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def step_forward(gates, proj, steps, cs, hs, out, order, a, prev, nxt, b, nb, roff):
    """One step of the ``b`` rows at slots ``gates[a:a+b]`` (gates i, f, o, g): adds the sources'
    projections ``proj[steps[slot]]`` to the ``h W_hh^T`` already in the slots (``prev < 0``: the
    first step, no recurrent term), activates them in place, writes ``c`` into ``cs[a:a+b]`` and
    ``h`` into ``hs[nxt:nxt+nb]`` (rows going on) or ``out[order[roff + r]]`` (rows finishing)."""
    hid = cs.shape[1]
    zero = np.zeros(hid, cs.dtype)
    for r in range(b):
        row = a + r
        g, p = gates[row], proj[steps[row]]
        if prev >= 0:
            for k in range(4 * hid):
                g[k] += p[k]
        else:
            for k in range(4 * hid):
                g[k] = p[k]
        # loops over views from offset 0: LLVM vectorises these, not loops starting at 3 * hid
        for k in range(3 * hid):
            g[k] = 0.5 + 0.5 * _tanh(0.5 * g[k])
        i, f, o, gg = g[:hid], g[hid : 2 * hid], g[2 * hid : 3 * hid], g[3 * hid :]
        for k in range(hid):
            gg[k] = _tanh(gg[k])
        c, c_prev = cs[row], cs[prev + r] if prev >= 0 else zero
        h = hs[nxt + r] if r < nb else out[order[roff + r]]
        for k in range(hid):
            c[k] = i[k] * gg[k] + f[k] * c_prev[k]
            h[k] = o[k] * _tanh(c[k])


@numba.njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def step_backward(gates, cs, dh, dc, dout, order, a, prev, b, nb, roff):
    """Gradients of step ``a`` (``b`` rows; :func:`step_forward`'s layout), in place: the activated
    gates at ``gates[a:a+b]`` become the pre-activation gradients. Rows ``< nb`` carry ``dh``
    (from the next step's ``dgates W_hh``) and ``dc``; the others finish here and read
    ``dout[order[roff + r]]`` (their ``dc`` rows must be zero: start ``dc`` zeroed). Leaves the
    ``dc`` carried to the previous step in ``dc[:b]``."""
    hid = cs.shape[1]
    zero = np.zeros(hid, cs.dtype)
    for r in range(b):
        row = a + r
        g, c, c_prev, d_c = gates[row], cs[row], cs[prev + r] if prev >= 0 else zero, dc[r]
        d_h = dh[r] if r < nb else dout[order[roff + r]]
        i, f, o, gg = g[:hid], g[hid : 2 * hid], g[2 * hid : 3 * hid], g[3 * hid :]
        for k in range(hid):
            t = _tanh(c[k])
            c_grad = d_c[k] + d_h[k] * o[k] * (1.0 - t * t)
            d_c[k] = c_grad * f[k]
            f[k] = c_grad * c_prev[k] * f[k] * (1.0 - f[k])
            o[k] = d_h[k] * t * o[k] * (1.0 - o[k])
            i_k = i[k]
            i[k] = c_grad * gg[k] * i_k * (1.0 - i_k)
            gg[k] = c_grad * i_k * (1.0 - gg[k] * gg[k])


@numba.njit(fastmath=True, cache=True, parallel=True)
def sum_by_source(dgates, by_src, src_ptr, out):
    """``out[v] = sum of dgates[by_src[src_ptr[v]:src_ptr[v + 1]]]`` (the projections' gradient,
    deterministic: each source's slots in a fixed order), rows in parallel."""
    width = dgates.shape[1]
    for v in numba.prange(out.shape[0]):
        for k in range(width):
            out[v, k] = 0.0
        for j in range(src_ptr[v], src_ptr[v + 1]):
            s = by_src[j]
            for k in range(width):
                out[v, k] += dgates[s, k]
