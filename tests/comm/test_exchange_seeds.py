"""Quantized exchanges take their rounding seeds without drawing from torch's generator."""

import torch

from tessera.comm.accounting import BACKWARD, FORWARD
from tessera.comm.exchange import Exchange, quantization_seed
from tessera.comm.group import single_process
from tessera.kernels.dropout import dropout_mask


def test_quantizing_leaves_the_dropout_stream_where_it_was():
    """The masks drawn after a quantized exchange are the masks drawn without one, so a low-bit run
    keeps the dropout and label-propagation draws of a 32-bit or one-process run."""
    ex = Exchange(single_process(), [0], [0])
    ex.configure(8, None)
    rows = torch.randn(0, 16)
    torch.manual_seed(3)
    ex.finish(ex.start(rows, 0, FORWARD))
    after_exchange = dropout_mask((50, 8), 0.5)
    torch.manual_seed(3)
    assert torch.equal(after_exchange, dropout_mask((50, 8), 0.5))


def test_seeds_follow_the_generator_and_differ_per_exchange():
    torch.manual_seed(0)
    seeds = {
        (layer, d, rank): quantization_seed(layer, d, rank)
        for layer in (0, 1)
        for d in (FORWARD, BACKWARD)
        for rank in (0, 1)
    }
    assert len(set(seeds.values())) == len(seeds)  # every layer, direction and rank rounds differently
    torch.manual_seed(0)
    assert quantization_seed(1, BACKWARD, 1) == seeds[(1, BACKWARD, 1)]  # same state, same seed
    torch.rand(1)
    assert quantization_seed(1, BACKWARD, 1) != seeds[(1, BACKWARD, 1)]  # the next epoch's draws move it
