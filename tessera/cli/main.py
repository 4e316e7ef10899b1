"""The ``tessera`` command: ``train``, ``predict``, ``info``, ``partition``, ``simulate``, ``plan`` and ``kernels``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from tessera.cli.launch import PEER_FAILED
from tessera.cli.values import int_or_auto
from tessera.cli.watch import (
    Stopped,
    interrupt_status,
    launcher_pid,
    launcher_reports,
    native_stderr_apart,
    resume_command,
    signal_name,
    stop_signals,
    watch_launcher,
)
from tessera.errors import ConfigError, DistributedError, TesseraError, os_error_line

#: ``tessera train``'s arguments naming its run directory, once it is known: what ``--resume``
#: adds to for the line a stopped run prints
_resume_argv: list[str] | None = None
_resume_out: str | None = None  # and that directory


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error of any subcommand in one ``tessera: error:`` line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"tessera: error: {message} (see {self.prog} --help)\n")


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is at the time of each message (a test's
    captured stream, a redirected one), not the stream it was created with."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _: object) -> None:
        pass


def log_to_stderr() -> None:
    """Print the ``tessera`` logger's messages of level INFO and above as ``tessera: ...`` lines
    on stderr (once per process; a level the caller set on the logger is kept)."""
    logger = logging.getLogger("tessera")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("tessera: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


#: the version a source tree reports when no installed package metadata names one
SOURCE_VERSION = "0.1.0"


def package_version() -> str:
    """The installed ``tessera-gnn`` distribution's version, else :data:`SOURCE_VERSION`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tessera-gnn")
    except PackageNotFoundError:
        return SOURCE_VERSION


def _add_dataset(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset", help="cora | citeseer | pubmed | ogbn-* | a path | synthetic:<preset> (default synthetic:small)"
    )
    p.add_argument("--name", help="which dataset, when a directory holds several (e.g. cora)")
    p.add_argument("--split", help="which split/<name> folder of an OGB directory, when it holds several")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tessera", description="Fast full-graph GNN training.")
    parser.add_argument(
        "--version", action="version", version=f"tessera {package_version()}", help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    t = sub.add_parser("train", help="train a model on a whole graph")
    _add_dataset(t)
    t.add_argument("--model", help="gcn | sage | sage-lstm | gin | gat | rgcn (default gcn; rgcn needs a typed graph)")
    t.add_argument("--hidden", type=int, help="hidden width (default 64)")
    t.add_argument("--layers", type=int, help="number of graph layers (default 2)")
    t.add_argument("--dropout", type=float, help="dropout probability (default 0.5)")
    t.add_argument("--heads", type=int, help="GAT attention heads (default 8)")
    t.add_argument("--num-bases", type=int, help="RGCN basis decomposition: bases shared by the relations")
    t.add_argument("--num-blocks", type=int, help="RGCN block-diagonal decomposition: blocks per relation weight")
    t.add_argument(
        "--rgcn-variant",
        help="RGCN relational sum: auto | transform_first | unique_source | aggregate_first | edge_wise | gtask | "
        "gtask:RESTRICTIONS, e.g. 'gtask:uniq(Dst.ID)=8 & uniq(Edge.Type)=1' (default auto: modelled, then measured)",
    )
    t.add_argument("--lr", type=float, help="Adam learning rate (default 0.01)")
    t.add_argument("--weight-decay", type=float, help="Adam weight decay (default 5e-4)")
    t.add_argument("--epochs", type=int, help="maximum epochs (default 200)")
    t.add_argument(
        "--patience",
        type=int,
        help="stop after this many epochs without a better validation accuracy; 0 = never (default 100)",
    )
    t.add_argument("--seed", type=int, help="random seed (default 0)")
    t.add_argument("--threads", type=int, help="CPU threads for torch and tessera kernels")
    t.add_argument("--backend", help="aggregation backend (default auto)")
    t.add_argument(
        "--device",
        help="auto | cpu | cuda | cuda:N: where the graph, model and training step live "
        "(default auto: this process's GPU when there is one, else the CPU)",
    )
    t.add_argument(
        "--aggregate-on",
        help="device | cpu | auto: where each layer's aggregation runs; cpu keeps the update on --device and "
        "aggregates on this host's CPU, pipelined (MixGCN's mixture of accelerators; GCN, SAGE, GIN); auto "
        "picks by a model of rates measured at set-up (default device)",
    )
    t.add_argument(
        "--mixture-stages",
        type=int,
        help="--aggregate-on cpu|auto: row batches the CPU's aggregation and the device's update overlap in "
        "(default 4)",
    )
    t.add_argument("--feature-norm", help="auto | row | none (default auto: row-normalise non-negative features)")
    t.add_argument(
        "--out",
        help="run directory for config.toml, metrics.jsonl, metrics.csv, result.json, checkpoint.pt (default "
        "runs/<model>-<dataset>-s<seed>, or the first of its -2, -3, ... that holds no run with other settings)",
    )
    t.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="replace the run in --out even if its settings differ (without it, such an --out is refused)",
    )
    t.add_argument(
        "--tensorboard", metavar="DIR", help="also write the per-epoch metrics as TensorBoard scalars to DIR"
    )
    t.add_argument("--checkpoint-every", type=int, help="epochs between checkpoints (default 10)")
    t.add_argument("--resume", action="store_true", default=None, help="continue from the checkpoint in --out")
    t.add_argument("--plot", action="store_true", default=None, help="write curves.png with loss and accuracy")
    t.add_argument(
        "--s-spmm",
        action="store_true",
        default=None,
        help="masked aggregation (S-SpMM) where dropout/ReLU masks allow it; same results, measured slower on CPU",
    )
    t.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="hide the progress bar")
    t.add_argument("--config", help="TOML file of settings named like the flags; flags override it")
    t.add_argument("--nprocs", type=int, help="train on N local worker processes (partition parallelism; default 1)")
    t.add_argument(
        "--strategy",
        help="auto | partition | tensor | hybrid, or one entry per layer (e.g. tensor,partition:post:8 or "
        "hybrid:2:prepost; an entry may end in @aggregate-first or @transform-first): how --nprocs ranks split each "
        "layer (halo exchange, MixGCN's feature split, or --groups column slices of halo-exchanging parts); auto "
        "plans per layer from modelled and measured costs (default auto)",
    )
    t.add_argument(
        "--groups",
        type=int,
        help="hybrid strategy: M column slices, each aggregated by nprocs/M halo-exchanging parts; M divides "
        "--nprocs (1 = partition, nprocs = tensor; default 1)",
    )
    t.add_argument(
        "--pipeline-stages",
        type=int_or_auto,
        help="tensor and hybrid strategies: row batches whose all-to-all back overlaps the next batch's "
        "aggregation, or auto: with --strategy auto the planner picks each layer's from 1, 2, 4, 8 (default 1)",
    )
    t.add_argument("--remote-agg", help="post | pre | prepost: how remote in-edges are aggregated (default prepost)")
    t.add_argument("--partition", help="metis | range | random (default metis)")
    t.add_argument(
        "--comm-bits",
        type=int_or_auto,
        help="bits per exchanged value: 32 | 8 | 4 | 2 (stochastic quantization), or auto: with --strategy auto the "
        "planner picks each layer's forward and backward widths where they save a fifth of its time (2 bits only "
        "with --label-prop; default 32)",
    )
    t.add_argument("--norm", help="none | layer: LayerNorm before each layer (default none)")
    t.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        help="storage of features, activations and gradients: bf16 halves it, with float32 weights and sums "
        "(gcn, sage, gin, gat on one process; default fp32)",
    )
    t.add_argument(
        "--memory",
        choices=("fast", "lean", "auto"),
        help="fast keeps every activation backward reads; lean keeps each hidden layer's input only and runs the "
        "layer again in backward (same values; less memory for models of 3+ layers, slower); auto is lean when "
        "a model of 3+ layers would not fit "
        "(default fast)",
    )
    t.add_argument(
        "--label-prop", type=float, help="share of training labels fed as input features each epoch (default 0)"
    )
    t.add_argument(
        "--parts-dir", help="train from a `tessera partition --out` directory: each rank reads only its part"
    )
    t.add_argument("--timeout", type=float, help="seconds a rank waits on its peers before failing (default 300)")
    t.add_argument(
        "--reorder",
        choices=("auto", "none", "rcm", "metis", "degree"),
        help="renumber vertices for cache locality while training (outputs keep the original order); "
        "auto measures graphs of 50k+ vertices and keeps an order only if aggregation is >10%% faster (default auto)",
    )

    i = sub.add_parser("info", help="print a dataset's size, degree statistics and splits")
    _add_dataset(i)

    p = sub.add_parser("partition", help="partition a graph and report cut, balance and halo sizes")
    _add_dataset(p)
    p.add_argument("--parts", type=int, required=True, help="number of parts")
    p.add_argument("--method", default="metis", help="metis | range | random (default metis)")
    p.add_argument("--seed", type=int, default=0, help="seed for metis and random (default 0)")
    p.add_argument("--out", help="write one file set per part here, for training with --parts-dir")

    from tessera.cli.simulate import add_parser as add_simulate

    add_simulate(sub)
    from tessera.cli.kernels import add_parser as add_kernels

    add_kernels(sub)
    from tessera.cli.plan import add_parser as add_plan

    add_plan(sub)
    from tessera.cli.predict import add_parser as add_predict

    add_predict(sub)
    return parser


def _cmd_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from tessera.comm.group import env_world_size
    from tessera.devices import training_device
    from tessera.train.config import FIELDS, make_config, read_toml
    from tessera.train.loop import announce_run_dir, run_dir, tensorboard_writer_class, train
    from tessera.train.setup import check_out_dir

    flags = {k: v for k, v in vars(args).items() if k in FIELDS}
    cfg = make_config(read_toml(args.config) if args.config else {}, flags)
    # a device this machine lacks is refused before anything is loaded, launched or written
    distributed = cfg.nprocs > 1 or env_world_size() > 1 or cfg.parts_dir is not None
    training_device(cfg.device, distributed, cfg.nprocs if env_world_size() <= 1 and cfg.nprocs > 1 else None)
    if cfg.tensorboard:
        tensorboard_writer_class()
    where = run_dir(cfg)
    check_out_dir(where.path)
    if int(os.environ.get("RANK", "0")) == 0:
        announce_run_dir(where)
    given_out, cfg.out = cfg.out, str(where.path)  # every rank and the Trainer write where this says
    global _resume_argv, _resume_out
    _resume_argv, _resume_out = (list(argv) if given_out else [*argv, "--out", cfg.out]), cfg.out
    if cfg.nprocs > 1 and env_world_size() <= 1:
        from tessera.cli.launch import launch

        return launch(argv if given_out else [*argv, "--out", cfg.out], cfg.nprocs)
    res = train(cfg)
    if not res:  # a non-zero rank: rank 0 reports
        return 0
    if "comm" in res:
        print(format_comm_summary(res["comm"], res["world_size"], res.get("comm_bits", [])))
    m = res.get("metric", "acc")
    shown = "ROC-AUC" if m == "rocauc" else "acc"  # a multi-label run's mean ROC-AUC over its tasks
    test, val = res[f"test_{m}"], res[f"val_{m}"]  # None: the graph has no vertices in that split
    test_text = "no test split" if test is None else f"test {shown} {test:.4f}"
    val_text = "no validation split (last epoch's weights)" if val is None else f"val {shown} {val:.4f}"
    print(
        f"{cfg.model} on {res['dataset']}: {test_text} | {val_text} "
        f"(best epoch {res['best_epoch']}) | median epoch {res['epoch_time_median_s'] * 1e3:.2f} ms | "
        f"peak RSS {max(res['peak_rss_mb_per_rank']):.0f} MiB"
        + (f" (largest of {res['world_size']} ranks)" if res["world_size"] > 1 else "")
        + f" | {cfg.out}"
    )
    return 0


def format_comm_summary(c: dict, world: int, bits: list[list[int]]) -> str:
    """The end-of-run table of bytes sent and time spent per layer and direction, with the bits
    per exchanged value of each (``bits[layer]``: forward, backward)."""
    lines = [
        f"communication over {c['epochs']} training epochs, {world} ranks:",
        f"{'layer':>5} {'dir':>4} {'bits':>4} {'data MB':>10} {'params MB':>10} {'exchange s':>11} {'quantize s':>11} {'compute s':>10}",
    ]
    for layer, row in enumerate(c["bytes_data"]):
        for d, name in enumerate(("fwd", "bwd")):
            width = bits[layer][d] if layer < len(bits) else 32
            lines.append(
                f"{layer:>5} {name:>4} {width:>4} {row[d] / 1e6:>10.3f} {c['bytes_params'][layer][d] / 1e6:>10.3f} "
                f"{c['exchange_s'][layer][d]:>11.3f} {c['quantize_s'][layer][d]:>11.3f} {c['compute_s'][layer][d]:>10.3f}"
            )
    total = sum(map(sum, c["bytes_data"])) + sum(map(sum, c["bytes_params"]))
    lines.append(f"total {total / 1e6:.3f} MB sent (times: slowest rank, summed over epochs)")
    return "\n".join(lines)


def _cmd_info(args: argparse.Namespace) -> int:
    from tessera.datasets import load

    g = load(args.dataset or "synthetic:small", name=args.name, split=args.split)
    d = g.degree_stats()
    print(f"dataset      {g.name}")
    print(f"vertices     {g.num_nodes:,}")
    print(f"edges        {g.num_edges:,} stored (directed CSR entries); undirected: {g.is_undirected()}")
    print(
        f"in-degree    mean {d['mean']:.2f}  max {d['max']:.0f}  p50 {d['p50']:.0f}  p90 {d['p90']:.0f}  p99 {d['p99']:.0f}"
    )
    print(f"features     {g.num_features}")
    if g.multilabel:
        print(f"classes      {g.num_classes} binary tasks (multi-label targets)")
    else:
        print(f"classes      {g.num_classes if g.num_classes is not None else '-'}")
    if g.num_relations is None:
        print("relations    - (untyped)")
    else:
        counts = g.relation_counts().tolist()
        print(
            f"relations    {g.num_relations}; edges per relation: "
            + " ".join(f"{r}:{c:,}" for r, c in enumerate(counts))
        )
    for split in ("train", "val", "test"):
        m = getattr(g, f"{split}_mask")
        print(f"{split + ' split':<12} {'-' if m is None else f'{int(m.sum()):,}'}")
    return 0


def _cmd_partition(args: argparse.Namespace) -> int:
    from tessera.datasets import load
    from tessera.graph.bandwidth import format_order_report, order_report
    from tessera.graph.partition import format_partition_report, partition, partition_stats, write_parts
    from tessera.graph.partition.halo import compare_modes
    from tessera.train.config import INT_RANGES
    from tessera.train.setup import check_out_dir

    lo, hi, _ = INT_RANGES["seed"]
    if not lo <= args.seed <= hi:
        raise ConfigError(f"--seed must be in [{lo}, {hi}], got {args.seed}")
    if args.out:
        check_out_dir(args.out)
    g = load(args.dataset or "synthetic:small", name=args.name, split=args.split)
    part = partition(g, args.parts, args.method, seed=args.seed)
    print(format_partition_report(partition_stats(g, part, args.parts)))
    rows = compare_modes(g.indptr.numpy(), g.indices.numpy(), part, args.parts)
    print(
        "rows sent per exchange (total / busiest rank): "
        + ", ".join(f"{m} {r['total']:,} / {r['max_rank']:,}" for m, r in rows.items())
    )
    print(format_order_report(order_report(g, args.parts, args.method, args.seed)))
    if args.out:
        print(f"wrote {write_parts(g, part, args.out, method=args.method)}")
    return 0


def _is_peer_failure(e: OSError) -> bool:
    """A connection that broke or timed out inside a distributed rank: a peer's failure, not the
    user's input (a path error names its file)."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return distributed and e.filename is None and isinstance(e, (ConnectionError, TimeoutError))


def _interrupted_line(e: KeyboardInterrupt) -> str | None:
    """The one line a stopped command prints, or None in a worker whose launcher prints it."""
    pid = launcher_pid()
    if pid is not None:
        if int(os.environ.get("RANK", "0")) != 0 or launcher_reports():
            return None  # the launcher reports, or rank 0 does when the launcher is gone
    signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}"
    if pid is not None:
        how = f"stopped: its launcher (pid {pid}) is gone"
    if _resume_argv is not None and _resume_out is not None:  # a train run whose directory is known
        if (Path(_resume_out) / "checkpoint.pt").is_file():
            return f"tessera: {how}; the last checkpoint is kept, continue with: {resume_command(_resume_argv)}"
        return f"tessera: {how}; no checkpoint was written yet, start again with: {resume_command(_resume_argv)}"
    return f"tessera: {how}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tessera`` console script; returns the exit status. SIGTERM and SIGHUP
    stop a command as Ctrl-C does (exit status 128 + the signal's number, 130 for Ctrl-C)."""
    watch_launcher()  # a worker of `tessera train --nprocs`: stop with the launcher, even a killed one
    native_stderr_apart()  # and its rank 0 keeps native libraries' messages off the terminal
    global _resume_argv, _resume_out
    _resume_argv = _resume_out = None
    with stop_signals():
        try:
            status = _main(argv)
            torchrun_peer_failed = status == PEER_FAILED and "TORCHELASTIC_RUN_ID" in os.environ
            if status != 0 and (launcher_pid() is not None or torchrun_peer_failed):
                # a failed worker has said what it had to: leaving now spares gloo's teardown,
                # which can abort a rank whose peer is gone, and the launcher reads this status
                # (torchrun's agent sends SIGTERM to a host's other workers once one has exited:
                # a worker still in its teardown then would end 143, not 3)
                _exit_now(status)
            return status
        except KeyboardInterrupt as e:  # also one that came as another command clause was reporting
            line = _interrupted_line(e)
            if line:
                print(line, file=sys.stderr)
            if launcher_pid() is not None:  # a stopped worker: its files are complete; skip torch's slow exit
                _exit_now(interrupt_status(e))
            return interrupt_status(e)


def program() -> NoReturn:
    """The ``tessera`` program (console script and ``python -m tessera``): :func:`main` in a process
    of its own. A rank of a distributed job ends without the interpreter's teardown once main has
    returned: its group is left and every file it wrote is complete, while the native teardown of
    torch's and gloo's threads can still abort a finished rank ("terminate called without an
    active exception") and turn a completed run into a failed one."""
    from tessera.comm.group import env_world_size

    status = main()
    if env_world_size() > 1:
        _exit_now(status)
    sys.exit(status)


def _exit_now(status: int) -> None:
    """End this worker process with ``status`` after flushing its output, without the interpreter's
    teardown (every file it wrote is complete: writes are atomic)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(status)


def _main(argv: Sequence[str] | None) -> int:
    log_to_stderr()
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed in one line
        return int(e.code or 0)
    if args.command is None:
        print(
            "tessera: error: no command given; choose train, predict, info, partition, simulate, plan or kernels (see tessera --help)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.command == "train":
            return _cmd_train(args, argv)
        if args.command == "partition":
            return _cmd_partition(args)
        if args.command == "simulate":
            from tessera.cli.simulate import run as run_simulate

            return run_simulate(args)
        if args.command == "plan":
            from tessera.cli.plan import run as run_plan

            return run_plan(args, argv)
        if args.command == "kernels":
            from tessera.cli.kernels import run as run_kernels

            return run_kernels(args)
        if args.command == "predict":
            from tessera.cli.predict import run as run_predict

            return run_predict(args)
        return _cmd_info(args)
    except DistributedError as e:
        # A worker died or a collective broke: not the user's input, so not status 2. Under
        # tessera's launcher the launcher prints the one line, naming the rank that failed first.
        if not os.environ.get("TESSERA_LAUNCHER_PID"):
            print(f"tessera: error: {e}", file=sys.stderr)
        return PEER_FAILED
    except TesseraError as e:
        print(f"tessera: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        # the backstop for every command: a file or directory the OS refused (permissions, a full
        # disk, a path through a file, a name too long, a link loop) is the user's to fix
        if _is_peer_failure(e):
            if not os.environ.get("TESSERA_LAUNCHER_PID"):
                print(f"tessera: error: a connection to a peer failed ({e}); a peer died or timed out", file=sys.stderr)
            return PEER_FAILED
        print(f"tessera: error: {os_error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
