"""``--pipeline-stages auto``: tensor and hybrid candidates come at 1, 2, 4 and 8 stages, each
modelled with its pipeline's overlap (batch k's all-to-all back beside batch k + 1's aggregation)
and its extra all-to-alls; the setting travels through flags and TOML; a fixed strategy refuses it."""

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
from tessera.planner.candidates import AUTO_STAGES, Candidate, Context, layer_candidates, pipelined_s, prune
from tessera.sparse import LayerSpec
from tessera.train.config import make_config, read_toml


def test_the_pipeline_hides_each_return_behind_the_next_batch():
    # aggregation 8 s in 4 batches of 2 s, returns of 1 s: 2 + 3 x 2 + 1 against 8 + 4 unpipelined
    assert math.isclose(pipelined_s(8.0, [1.0] * 4), 9.0)
    # returns longer than a batch: the returns set the pace (4 + 5 + 5 against 8 + 10)
    assert math.isclose(pipelined_s(8.0, [5.0, 5.0]), 14.0)
    assert math.isclose(pipelined_s(8.0, [5.0]), 13.0)  # one stage: nothing overlaps


def _ring(n: int = 20000) -> Graph:
    i = torch.arange(n)
    src = torch.cat([i, i, i])
    dst = torch.cat([(i + 1) % n, (i - 1) % n, (i + n // 3) % n])
    return Graph.from_edge_index(torch.stack([src, dst]), n)


def _tensor(latency_us: float) -> dict[int, Candidate]:
    # aggregation at 1 ns per value, a 1 GB/s link: a batch's aggregation and its return are
    # of the same order, so overlap pays unless each extra all-to-all costs much
    rates = Rates(edge_s=0.0, value_s=1e-9, gemm_flops=1e12, bandwidth_gbps=1.0, latency_us=latency_us)
    g = _ring()
    ctx = Context(g, 2, np.repeat(np.arange(2), g.num_nodes // 2), StrategyOptions(), rates, stages=AUTO_STAGES)
    spec = LayerSpec(256, 256, 256, aggregates_first=True)
    out = {}
    for c in layer_candidates(ctx, {True: spec}, True, True):
        if c.kind == "tensor":
            out[c.choice.options(StrategyOptions()).pipeline_stages] = c
    return out


def test_stages_pay_where_batches_are_cheap_and_not_where_each_costs_a_long_latency():
    cheap, dear = _tensor(1.0), _tensor(20000.0)
    assert sorted(cheap) == list(AUTO_STAGES) and sorted(dear) == list(AUTO_STAGES)
    assert min(cheap, key=lambda s: cheap[s].modelled_s) > 1
    assert min(dear, key=lambda s: dear[s].modelled_s) == 1
    # the model's comm term carries the overlap: same aggregation, less comm with more stages
    assert cheap[4].model_s.aggregate == cheap[1].model_s.aggregate and cheap[4].model_s.comm < cheap[1].model_s.comm
    # pruning measures one stage count per family: the modelled best
    kept = [c for c in prune(list(cheap.values()), float("inf"), limit=2) if c.kind == "tensor"]
    assert len(kept) == 1 and kept[0] is min(cheap.values(), key=lambda c: c.modelled_s)


def test_entries_name_a_layers_stages():
    base = StrategyOptions()
    for text, stages in (("tensor:32:4", 4), ("hybrid:2:pre:8/32:2", 2), ("tensor:8", 1)):
        choice = parse_entry(text)
        assert choice.options(base).pipeline_stages == stages and choice.label(base) == text
    assert parse_entry("tensor:8").options(StrategyOptions(pipeline_stages=3)).pipeline_stages == 3
    for bad in ("tensor:32:0", "tensor:32:x", "hybrid:2:pre:32:2:9"):
        with pytest.raises(ConfigError):
            parse_entry(bad)


def test_auto_stages_travel_through_flags_and_toml(tmp_path):
    cfg = make_config({}, {"pipeline_stages": "auto", "nprocs": 2})
    f = tmp_path / "run.toml"
    f.write_text(cfg.to_toml())
    assert 'pipeline-stages = "auto"' in f.read_text() and make_config(read_toml(f), {}).pipeline_stages == "auto"
    with pytest.raises(ConfigError, match="--pipeline-stages auto lets the planner"):
        make_config({}, {"pipeline_stages": "auto", "nprocs": 2, "strategy": "tensor"})
    with pytest.raises(ConfigError, match=r"--pipeline-stages must be in \[1, 1024\]"):
        make_config({}, {"pipeline_stages": 0, "nprocs": 2})


def test_tessera_plan_model_only_chooses_stages(capsys):
    argv = ["plan", "--dataset", "synthetic:tiny", "--nprocs", "2", "--model-only", "--pipeline-stages", "auto"]
    assert main([*argv, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    labels = [c["label"] for la in rec["layers"] for c in la["candidates"] if c["label"].startswith("tensor")]
    assert {parse_entry(lab).options(StrategyOptions()).pipeline_stages for lab in labels} == set(AUTO_STAGES)


def test_a_pipelined_survivor_is_measured_beside_its_one_stage_twin():
    from tessera.planner.plan import one_stage_twins

    cheap = _tensor(1.0)
    twins = one_stage_twins(list(cheap.values()), {cheap[8].label}, StrategyOptions())
    assert [t.label for t in twins] == [cheap[1].label]
    assert one_stage_twins(list(cheap.values()), {cheap[1].label}, StrategyOptions()) == []
