"""SuperGCN's communication performance model (§5.4 Eq. 2, §6.2 Eq. 3–8) over simulated volumes.

For one exchange with ``rows[i, j]`` rows from rank ``i`` to rank ``j``, ``B_ij`` its bytes
(``tessera.comm.wire.block_bytes``: data plus, below 32 bits, a scale and zero point per group of
``GROUP_ROWS`` rows) and ``data_w`` the data bytes of one row::

    T_comm^{i,j}  = B_ij / BW + L                       (pairs with traffic; Eq. 2, Eq. 5)
    T_quant^{i,j} = rows_ij * (4 w + data_w) / TH       (fp32 read + intX written; Eq. 4, b < 32)
    T_dequant^{j,i} = T_quant^{i,j}                     (``j`` dequantizes what ``i`` sent; Eq. 4)
    T_pre^i       = owned_i * w_in * 4 / TH             (LayerNorm before the layer; Eq. 3)
    T             = max_i ( T_pre^i + sum_j T_comm^{i,j} + T_quant^{i,j} + T_dequant^{j,i} )  (Eq. 6)

so, as in the paper, a sender's critical path holds quantizing, sending and dequantizing its own
messages (Eq. 8's ``2 alpha (1 + gamma)`` term); a single pair gives Eq. 8 exactly.

Links of two speeds: where the model knows each rank's host (``CommModel.hosts``, with an
inter-host link measured), ``BW`` and ``L`` are the intra-host link's for pairs on one host, and a
host's link to the others is one link its ranks share: sender ``i``'s term for its pairs on other
hosts is the bytes *all ranks of its host* send off the host over the inter-host bandwidth, plus
the inter-host latency per message of its own. (A ``tbf``-capped veth, or a NIC, is one queue for
every process behind it.) ``shares[i]`` counts the exchanges of the same shape that run at once
through ``i``'s host link beside ``i``'s own (hybrid's column groups each exchange their halo at
the same time), so a host's off-host bytes are each sender's times its ``shares``.

Each exchange is an ``all_to_all`` every rank waits for, so an epoch's time is the sum over its
exchanges of their ``T``. Local aggregation is not in the paper's model, nor here. ``T_pre`` is
counted on forward exchanges whenever the model has LayerNorm (``norm="layer"``), at any bit width,
since tessera runs LayerNorm independently of quantization (SuperGCN counts it only with Int2,
where it introduces it); the label-embedding add is a few rows and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from tessera.comm.wire import block_bytes, data_bytes, group_rows
from tessera.errors import ConfigError
from tessera.planner.records import Record, field_sums, optional

if TYPE_CHECKING:
    from tessera.planner.volume.partition import PartitionVolumes
    from tessera.planner.volume.tensor import TensorVolumes

DEFAULT_BANDWIDTH_GBPS = 12.5  # 100 Gb/s InfiniBand / Ethernet class link, per rank
DEFAULT_LATENCY_US = 5.0  # typical MPI small-message latency on such a network
DEFAULT_QUANT_GBPS = 25.8  # a 2-core STREAM triad (docs/design/planner-calibration.md)


@dataclass(frozen=True)
class CommModel(Record):
    """Hardware constants: link bandwidth and per-message latency (``BW_comm``, ``L_comm``) and the
    memory throughput quantization, dequantization and LayerNorm stream at (``TH_cal``)."""

    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS
    latency_us: float = DEFAULT_LATENCY_US
    quant_gbps: float = DEFAULT_QUANT_GBPS
    hosts: tuple[int, ...] = ()  # each rank's host (); empty: one link for every pair
    inter_gbps: float = 0.0  # a host's link to the other hosts, shared by its ranks
    inter_latency_us: float = 0.0
    shares: tuple[int, ...] = ()  # per rank: same-shaped exchanges through its host link at once (): 1

    def among(self, ranks, shares=None) -> CommModel:
        """The model of an exchange among ``ranks`` only (its rows and columns in this order),
        each with ``shares`` exchanges like it through its host's link (default 1)."""
        if not self.hosts:
            return self
        kept = tuple(self.hosts[int(r)] for r in ranks)
        return replace(self, hosts=kept, shares=tuple(int(s) for s in shares) if shares is not None else ())

    def two_links(self) -> bool:
        """Whether the hosts of the ranks are known, with a link between hosts of its own."""
        return self.inter_gbps > 0 and len(self.hosts) > 0

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0 or not self.quant_gbps > 0:
            raise ConfigError(
                f"bandwidth and quantization throughput must be positive, got {self.bandwidth_gbps} and {self.quant_gbps} GB/s"
            )
        if not self.latency_us >= 0:
            raise ConfigError(f"latency must be non-negative, got {self.latency_us} us")


@dataclass(frozen=True)
class ExchangeTime(Record):
    """Eq. 6 for one exchange: the slowest rank's time and its parts (seconds), and that rank."""

    time_s: float
    comm_s: float
    quant_s: float
    pre_quant_s: float
    rank: int


@dataclass(frozen=True)
class LayerTimes(Record):
    """One layer's exchanges in a training epoch (None: no such exchange)."""

    layer: int
    forward: ExchangeTime | None
    backward: ExchangeTime | None


@dataclass(frozen=True)
class EpochTimes(Record):
    """A training epoch's exchanges summed (seconds)."""

    time_s: float
    comm_s: float
    quant_s: float
    pre_quant_s: float


@dataclass(frozen=True)
class Eq7Ratios(Record):
    """Eq. 7's ratios for one pair and Eq. 8's speedup (1.0 where the latency ratio is infinite)."""

    alpha: float
    beta: float
    gamma: float
    delta: float
    speedup: float


@dataclass(frozen=True, kw_only=True)
class Projection(Record):
    """Projected times of one mode at one bit width: per layer, per epoch, Eq. 7/8 at layer 0's
    busiest sender (below 32 bits) and the epoch's speedup over fp32 post (None when that
    baseline was not simulated)."""

    layers: tuple[LayerTimes, ...]
    epoch: EpochTimes
    eq8_layer0: Eq7Ratios | None = optional()
    speedup_vs_fp32_post: float | None = None


def sender_time(
    data: np.ndarray, params: np.ndarray, values: np.ndarray, data_sent: np.ndarray, bits: int, m: CommModel
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 2 and Eq. 4 per sender of one exchange whose ``[i, j]`` block holds ``data`` and
    ``params`` bytes: (sum over peers of ``B_ij / BW + L``, quantize + dequantize streaming of
    its ``values`` fp32 values read and ``data_sent`` bytes written, b < 32)."""
    bw, th, lat = m.bandwidth_gbps * 1e9, m.quant_gbps * 1e9, m.latency_us * 1e-6
    sent = data + params
    if m.two_links() and len(m.hosts) == sent.shape[0]:
        host = np.asarray(m.hosts)
        same = host[:, None] == host[None, :]
        local = np.where(same, sent, 0)
        shares = np.asarray(m.shares, dtype=np.float64) if m.shares else np.ones(host.size)
        off_host = np.bincount(host, weights=np.where(same, 0, sent).sum(axis=1) * shares)  # bytes leaving each host
        comm = (
            local.sum(axis=1) / bw
            + np.count_nonzero(local, axis=1) * lat
            + off_host[host] / (m.inter_gbps * 1e9)
            + np.count_nonzero(np.where(same, 0, sent), axis=1) * m.inter_latency_us * 1e-6
        )
    else:
        comm = sent.sum(axis=1) / bw + np.count_nonzero(sent, axis=1) * lat
    quant = 2 * (4 * values + data_sent) / th if bits < 32 else np.zeros(comm.shape)
    return comm, quant


def exchange_time(
    rows: np.ndarray,
    width: int,
    bits: int,
    m: CommModel,
    owned: np.ndarray | None = None,
    norm_width: int = 0,
) -> ExchangeTime:
    """Eq. 6 for one exchange (sender x receiver ``rows``): the slowest rank's time and its parts;
    ``owned`` and ``norm_width`` add Eq. 3's LayerNorm term."""
    rows = np.asarray(rows)
    data, params = block_bytes(rows, width, bits)
    sent = rows.sum(axis=1)
    comm, quant = sender_time(data, params, sent * width, sent * data_bytes(width, bits), bits, m)
    th = m.quant_gbps * 1e9
    pre = owned * norm_width * 4 / th if owned is not None and norm_width else np.zeros(sent.shape)
    total = pre + comm + quant
    i = int(np.argmax(total)) if total.size else 0
    if not total.size:
        return ExchangeTime(0.0, 0.0, 0.0, 0.0, 0)
    return ExchangeTime(float(total[i]), float(comm[i]), float(quant[i]), float(pre[i]), i)


def blocks_time(blocks: list[tuple[np.ndarray, np.ndarray]], bits: int, m: CommModel) -> float:
    """Eq. 6 summed over all-to-alls whose blocks carry their own widths: per all-to-all, ``rows``
    and ``widths`` (sender x receiver, as :func:`~tessera.parallel.tensor.exchange_blocks` gives
    them), the slowest sender's bytes over BW plus a latency per peer plus, below 32 bits, its
    quantize and dequantize streaming. The diagonal stays on the rank."""
    total = 0.0
    for rows, widths in blocks:
        per_rank = blocks_sender_s(rows, widths, bits, m)
        total += float(per_rank.max()) if per_rank.size else 0.0
    return total


def blocks_sender_s(rows: np.ndarray, widths: np.ndarray, bits: int, m: CommModel) -> np.ndarray:
    """Eq. 2/4 per sender of one exchange whose pair ``[i, j]`` sends a block of ``rows[i, j]``
    rows ``widths[i, j]`` wide (``widths`` may be a number): its bytes over BW, a latency per
    peer it sends rows and, below 32 bits, its quantize and dequantize streaming. The diagonal
    stays on the rank."""
    bw, th, lat = m.bandwidth_gbps * 1e9, m.quant_gbps * 1e9, m.latency_us * 1e-6
    rows = np.array(rows, dtype=np.int64)
    np.fill_diagonal(rows, 0)
    per_rank = np.zeros(rows.shape[0])
    uniform = np.ndim(widths) == 0  # one width: no per-width copies of a P x P matrix
    for w in [int(widths)] if uniform else np.unique(widths[rows > 0]):
        r = rows if uniform else np.where(widths == w, rows, 0)
        data, params = block_bytes(r, int(w), bits)
        per_rank += (data + params).sum(axis=1) / bw
        if bits < 32:
            per_rank += 2 * r.sum(axis=1) * (4 * int(w) + data_bytes(int(w), bits)) / th
    return per_rank + np.count_nonzero(rows, axis=1) * lat


def eq8_speedup(alpha: float, beta: float, gamma: float, delta: float) -> float:
    """SuperGCN Eq. 8: ``T_comm / T_quant_comm`` for one pair, from the ratios of Eq. 7."""
    return alpha * beta * (gamma + delta) / ((1 + delta) * alpha * beta + 2 * alpha * (1 + gamma) + beta * gamma)


def eq7_ratios(pair_rows: float, width: int, bits: int, m: CommModel) -> Eq7Ratios:
    """Eq. 7's alpha (values per parameter), beta (TH / BW), gamma (32 / b) and delta (latency over
    the quantized transfer time) for a pair sending ``pair_rows`` rows, and Eq. 8's speedup."""
    data_time = pair_rows * width * bits / 8 / (m.bandwidth_gbps * 1e9)
    groups = max(np.ceil(pair_rows / group_rows()), 1)
    alpha = pair_rows * width / (2 * groups)  # two fp32 parameters (scale, zero) per group of rows
    beta, gamma = m.quant_gbps / m.bandwidth_gbps, 32 / bits
    delta = m.latency_us * 1e-6 / data_time if data_time > 0 else float("inf")
    speedup = eq8_speedup(alpha, beta, gamma, delta) if np.isfinite(delta) else 1.0
    return Eq7Ratios(alpha, beta, gamma, delta, speedup)


def _exchanges(vol: PartitionVolumes, mode: str, bits: int, m: CommModel) -> tuple[LayerTimes, ...]:
    """Eq. 6 per layer: forward and (where there is one) backward."""
    out = []
    for layer, (width, back, rows, _) in enumerate(vol.exchanges[mode][bits]):
        if not width:  # aggregated once: nothing per steady epoch
            out.append(LayerTimes(layer, None, None))
            continue
        norm_w = vol.layer_inputs[layer] if vol.norm == "layer" else 0
        fwd = exchange_time(rows, width, bits, m, vol.owned, norm_w)
        bwd = exchange_time(rows.T, width, bits, m) if back else None
        out.append(LayerTimes(layer, fwd, bwd))
    return tuple(out)


def project(vol: PartitionVolumes, m: CommModel) -> dict[str, dict[int, Projection]]:
    """Projected times per mode and bit width of :func:`simulate_volumes`' result: per exchange,
    per epoch (sum over exchanges), Eq. 7/8 at layer 0's busiest sender, and speedup over fp32
    post (None when that baseline was not simulated)."""
    out: dict[str, dict[int, Projection]] = {}
    for mode, per_mode in vol.modes.items():
        out[mode] = {}
        for bits in per_mode.bits:
            layers = _exchanges(vol, mode, bits, m)
            ex = [d for la in layers for d in (la.forward, la.backward) if d is not None]
            epoch = EpochTimes(**field_sums(ex, "time_s", "comm_s", "quant_s", "pre_quant_s"))
            rows = vol.rows[mode]
            busiest = int(np.argmax(rows.sum(axis=1))) if rows.size else 0
            active = max(int(np.count_nonzero(rows[busiest])), 1)
            eq8 = eq7_ratios(rows[busiest].sum() / active, vol.widths[0] or 1, bits, m) if bits < 32 else None
            out[mode][bits] = Projection(layers=layers, epoch=epoch, eq8_layer0=eq8)
    base = out.get("post", {}).get(32)
    for projected in out.values():
        for bits, entry in projected.items():
            t = entry.epoch.time_s
            speedup = base.epoch.time_s / t if base and t > 0 else None
            projected[bits] = replace(entry, speedup_vs_fp32_post=speedup)
    return out


def project_tensor(tv: TensorVolumes, m: CommModel) -> dict[int, float]:
    """Projected all-to-all seconds per training epoch of :func:`~tessera.planner.volume.tensor.tensor_volumes`'
    result, per bit width: every aggregation's all-to-alls (forward, and backward where the layer
    has one) and attention layers' term all-gather and reduce-scatter (float32), through
    :func:`blocks_time`."""
    from tessera.parallel.tensor import exchange_blocks
    from tessera.parallel.tensor_attention import term_blocks

    out = {}
    for bits in tv.bits:
        t = 0.0
        for width, back, terms in zip(tv.widths, tv.backward, tv.terms, strict=True):
            if not width:
                continue
            one = blocks_time(exchange_blocks(tv.counts, width, tv.stages), bits, m)
            t += one * (2 if back else 1)
            if terms:
                t += blocks_time(term_blocks(tv.counts, terms)[: 2 if back else 1], 32, m)
        out[int(bits)] = t
    return out
