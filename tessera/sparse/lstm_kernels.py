"""The LSTM recurrence's elementwise steps: one step's cell update and gate gradients, each in
one pass, as numba kernels over NumPy views of CPU tensors and as torch ops for any device."""

from __future__ import annotations

import numba
import torch


@numba.njit(fastmath=True, cache=True, nogil=True)
def cell_backward(gates, cs, tc, dgates, dh, dc, dout, a, prev, b, nb):
    """Step gradients of the ``b`` rows at ``gates[a:a+b]`` (activated, gates i, f, o, g;
    ``tc = tanh(c)``; ``prev``: the previous step's offset in ``cs``, -1 at the first step).
    Rows ``>= nb`` finish here and take ``dh`` from ``dout`` with no carried ``dc``; writes
    ``dgates[a:a+b]`` (pre-activation) and the ``dc`` carried to the previous step."""
    hid = cs.shape[1]
    for r in range(b):
        row = a + r
        last = r >= nb
        for k in range(hid):
            i = gates[row, k]
            f = gates[row, hid + k]
            o = gates[row, 2 * hid + k]
            g = gates[row, 3 * hid + k]
            t = tc[r, k]
            h_grad = dout[r, k] if last else dh[r, k]
            c_grad = (0.0 if last else dc[r, k]) + h_grad * o * (1.0 - t * t)
            dgates[row, k] = c_grad * g * i * (1.0 - i)
            dgates[row, hid + k] = c_grad * cs[prev + r, k] * f * (1.0 - f) if prev >= 0 else 0.0
            dgates[row, 2 * hid + k] = h_grad * t * o * (1.0 - o)
            dgates[row, 3 * hid + k] = c_grad * i * (1.0 - g * g)
            dc[r, k] = c_grad * f


@numba.njit(fastmath=True, cache=True, nogil=True)
def cell_state(gates, cs, a, prev, b):
    """``c = i * g + f * c_prev`` for the ``b`` rows at ``gates[a:a+b]`` (activated), into
    ``cs[a:a+b]`` (``prev``: the previous step's offset in ``cs``, -1 at the first step)."""
    hid = cs.shape[1]
    for r in range(b):
        row = a + r
        for k in range(hid):
            c = gates[row, k] * gates[row, 3 * hid + k]
            if prev >= 0:
                c += gates[row, hid + k] * cs[prev + r, k]
            cs[row, k] = c


@numba.njit(fastmath=True, cache=True, nogil=True)
def cell_output(gates, tc, hs, out, a, nxt, b, nb):
    """``h = o * tanh(c)`` for the ``b`` rows at ``gates[a:a+b]``: rows ``< nb`` go on to
    ``hs[nxt:nxt+nb]`` (the next step's input), the others finish into ``out[nb:b]``."""
    hid = tc.shape[1]
    for r in range(b):
        row = a + r
        for k in range(hid):
            h = gates[row, 2 * hid + k] * tc[r, k]
            if r < nb:
                hs[nxt + r, k] = h
            else:
                out[r, k] = h


# The same three updates in torch ops, for tensors off the CPU (and ``--backend torch``): the
# arguments and in-place writes are the numba kernels', so the recurrence calls either set.


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
