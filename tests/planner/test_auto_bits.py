"""``--comm-bits auto``: the planner chooses each layer's forward and backward exchange widths,
below 32 bits only where that saves AUTO_BITS_GAIN of the layer's modelled and measured time; the
setting travels through flags, TOML and the run's files, and a fixed strategy refuses it."""

import json
import math

import numpy as np
import pytest
import torch

from tessera import Graph
from tessera.cli.main import main
from tessera.errors import ConfigError
from tessera.parallel.base import StrategyOptions
from tessera.parallel.mixed import parse_entry
from tessera.planner.calibrate import Rates
from tessera.planner.candidates import AUTO_BITS_GAIN, BIT_FIELDS, Context, choice_bits, choice_key, layer_candidates
from tessera.planner.plan import CandidateRow, Costs, pick_measured
from tessera.sparse import LayerSpec
from tessera.train.config import TrainConfig, make_config, read_toml
from tessera.train.planning import auto_bit_widths


def _rates(gbps: float) -> Rates:
    return Rates(edge_s=1e-9, value_s=1e-10, gemm_flops=1e11, bandwidth_gbps=gbps, latency_us=5.0)


def _ring(n: int = 4000) -> Graph:
    """A ring with chords: every range part of it has cut edges to exchange."""
    i = torch.arange(n)
    src = torch.cat([i, i, i])
    dst = torch.cat([(i + 1) % n, (i - 1) % n, (i + n // 2) % n])
    return Graph.from_edge_index(torch.stack([src, dst]), n)


def _candidates(gbps: float, input_grad: bool, auto: bool = True):
    g = _ring()
    part = np.repeat(np.arange(4), g.num_nodes // 4)
    ctx = Context(g, 4, part, StrategyOptions(), _rates(gbps), (32, 8, 4), auto)
    spec = LayerSpec(64, 64, 64, aggregates_first=True)
    return layer_candidates(ctx, {True: spec}, True, input_grad)


def test_a_slow_link_plans_quantized_exchanges_and_a_fast_one_keeps_32_bits():
    slow, fast = _candidates(1e-3, True), _candidates(100.0, True)
    assert choice_bits(slow[0].choice, StrategyOptions()) != (32, 32), slow[0].label
    assert {choice_bits(c.choice, StrategyOptions()) for c in fast} == {(32, 32)}, [c.label for c in fast]


def test_every_quantized_candidate_saves_the_gain_against_its_32_bit_twin():
    base = StrategyOptions()
    for gbps in (1e-3, 0.05, 1.0):
        cands = _candidates(gbps, True)
        full = {
            choice_key(c.choice, BIT_FIELDS): c.modelled_s for c in cands if choice_bits(c.choice, base) == (32, 32)
        }
        assert full, gbps
        for c in cands:
            if choice_bits(c.choice, base) != (32, 32):
                assert c.modelled_s <= (1 - AUTO_BITS_GAIN) * full[choice_key(c.choice, BIT_FIELDS)] + 1e-15, (
                    gbps,
                    c.label,
                )
        # without auto_bits every width stays, one per choice and direction pair
        every = _candidates(gbps, True, auto=False)
        assert {choice_bits(c.choice, base) for c in every} == {(32, 32), (8, 8), (4, 4)}


def test_directions_take_their_own_widths_only_where_there_is_a_backward_exchange():
    base = StrategyOptions()
    with_grad = {choice_bits(c.choice, base) for c in _candidates(1e-3, True)}
    assert any(f != b for f, b in with_grad), with_grad  # e.g. 4/8: the two exchanges cost differently
    without = {choice_bits(c.choice, base) for c in _candidates(1e-3, False)}
    assert without and all(f == b for f, b in without), without


def test_a_per_direction_candidate_costs_each_direction_at_its_own_width():
    cands = {c.label: c for c in _candidates(1e-3, True, auto=False)}
    ctx_pair = {c.label: c for c in _candidates(1e-3, True) if c.label.startswith("partition:prepost:")}
    half = [lab for lab in ctx_pair if lab.endswith(":8/4") or lab.endswith(":4/8")]
    # forward at 8 and backward at 4 costs what half of each same-width candidate's exchange costs
    eight, four = cands["partition:prepost:8"].model_s.comm, cands["partition:prepost:4"].model_s.comm
    for lab in half:
        assert math.isclose(ctx_pair[lab].model_s.comm, (eight + four) / 2, rel_tol=0.05), (lab, eight, four)


def _row(label: str, measured: float | None) -> CandidateRow:
    return CandidateRow(
        label=label, kind="partition", width=64, backward=True, model_ms=Costs(0, 0, 0), modelled_ms=1.0,
        measured_ms=measured, survived=True,
    )  # fmt: skip


def test_the_measured_pick_takes_fewer_bits_only_for_a_large_saving():
    base = StrategyOptions()
    small = [_row("partition:prepost:32", 10.0), _row("partition:prepost:8", 9.0)]
    large = [_row("partition:prepost:32", 10.0), _row("partition:prepost:8/32", 7.0)]
    assert pick_measured(small, base, auto_bits=True).label == "partition:prepost:32"
    assert pick_measured(large, base, auto_bits=True).label == "partition:prepost:8/32"
    assert pick_measured(small, base).label == "partition:prepost:8"  # a listed width is taken when fastest
    # no full-width candidate measured: the model already asked for the saving
    assert pick_measured([_row("tensor:4", 3.0), _row("tensor:8", 4.0)], base, auto_bits=True).label == "tensor:4"


def test_the_measured_slots_go_to_strategies_and_the_best_full_width_step_is_always_measured():
    from tessera.datasets import load
    from tessera.nn import build_model
    from tessera.planner.plan import MAX_MEASURED, modelled_layers
    from tessera.train.planning import model_probe

    g = load("synthetic:tiny")
    probe = model_probe(build_model("gcn", g.num_features, 16, g.num_classes, 2), TrainConfig(nprocs=4))
    part = np.arange(g.num_nodes) % 4
    ctx = Context(g, 4, part, StrategyOptions(), _rates(1e-4), (32, 8, 4), True)
    _, survivors = modelled_layers(ctx, probe)
    base = StrategyOptions()
    for kept in survivors:
        chosen = [parse_entry(label) for label in kept]
        assert len(kept) <= MAX_MEASURED + 1, kept
        assert (32, 32) in {c.options(base).exchange_bits() for c in chosen}, kept
        narrow = [c for c in chosen if c.options(base).exchange_bits() != (32, 32)]
        assert len({choice_key(c, BIT_FIELDS) for c in narrow}) == len(narrow), kept  # one width per strategy family


def test_entries_name_a_width_per_direction():
    base = StrategyOptions()
    for text, bits in (("partition:prepost:8/32", (8, 32)), ("tensor:4/2", (4, 2)), ("hybrid:2:pre:32/8", (32, 8))):
        choice = parse_entry(text)
        assert choice.options(base).exchange_bits() == bits and choice.label(base) == text
    assert parse_entry("tensor:8/8").label(base) == "tensor:8"
    for bad in ("partition:post:8/16", "tensor:8/32/4", "tensor:/8"):
        with pytest.raises(ConfigError, match="forward/backward bits"):
            parse_entry(bad)


def test_auto_considers_2_bits_only_with_label_propagation():
    assert auto_bit_widths(TrainConfig()) == (32, 8, 4)
    assert auto_bit_widths(TrainConfig(label_prop=0.5)) == (32, 8, 4, 2)


def test_auto_travels_through_flags_toml_and_the_saved_settings(tmp_path):
    cfg = make_config({}, {"comm_bits": "auto", "nprocs": 2})
    assert cfg.comm_bits == "auto"
    f = tmp_path / "run.toml"
    f.write_text(cfg.to_toml())
    assert 'comm-bits = "auto"' in f.read_text()
    assert make_config(read_toml(f), {}).comm_bits == "auto"
    assert make_config({}, {"comm_bits": 8}).comm_bits == 8
    with pytest.raises(ConfigError, match='an integer or "auto"'):
        make_config({}, {"comm_bits": "fast"})
    with pytest.raises(ConfigError, match="32, 8, 4, 2 or auto"):
        make_config({}, {"comm_bits": 16})


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--comm-bits", "most"], "expected an integer or auto"),
        (["--comm-bits", "auto", "--nprocs", "2", "--strategy", "partition"], "--comm-bits auto lets the planner"),
    ],
)
def test_bad_or_unplannable_auto_is_one_line(argv, needle, tmp_path, capsys):
    assert main(["train", "--dataset", "synthetic:tiny", "--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessera: error: ") and needle in err[0], err
    assert not (tmp_path / "run").exists()


def test_tessera_plan_model_only_picks_widths_per_link(capsys):
    picks = {}
    for gbps in ("100", "0.00001"):  # 10 kB/s: exchanges dwarf any timing noise of the local rates
        argv = ["plan", "--dataset", "synthetic:tiny", "--nprocs", "2", "--model-only", "--comm-bits", "auto"]
        assert main([*argv, "--bandwidth-gbps", gbps, "--json"]) == 0
        rec = json.loads(capsys.readouterr().out)
        picks[gbps] = [parse_entry(c).options(StrategyOptions()).exchange_bits() for c in rec["choices"]]
    assert picks["100"] == [(32, 32), (32, 32)], picks
    assert all(b != (32, 32) for b in picks["0.00001"]), picks
