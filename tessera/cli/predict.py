"""The ``tessera predict`` subcommand: a trained run's predicted class of every vertex, written
to a ``.npy`` (int64, one per vertex) or ``.csv`` (``vertex,class``) file; of a multi-label run the
0/1 prediction of every task (``.npy``: int64 vertices x tasks; ``.csv``: ``vertex,task0,task1,...``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError, os_error_line

SUFFIXES = (".npy", ".csv")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``predict`` on an ``add_subparsers()`` object; returns its parser."""
    s = subparsers.add_parser(
        "predict", help="write a trained run's predicted class of every vertex (best-validation weights)"
    )
    s.add_argument("--run", required=True, help="the run directory `tessera train --out` wrote")
    s.add_argument("--dataset", help="the graph to predict on (default: the run's dataset), as train --dataset")
    s.add_argument("--name", help="which dataset, when a directory holds several (e.g. cora)")
    s.add_argument("--split", help="which split/<name> folder of an OGB directory, when it holds several")
    s.add_argument("--out", help="a .npy or .csv file for the classes (default <run>/predictions.npy)")
    return s


def run(args: argparse.Namespace) -> int:
    """Run ``tessera predict``; returns the exit status."""
    from tessera.files import atomic_write, save_npy
    from tessera.train.api import load_run

    out = Path(args.out) if args.out else Path(args.run) / "predictions.npy"
    if out.suffix.lower() not in SUFFIXES:
        raise ConfigError(f"--out {out} must end in .npy or .csv")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; name a .npy or .csv file")
    result = load_run(args.run)
    graph = None
    if args.dataset:
        from tessera.datasets import load

        graph = load(args.dataset, name=args.name, split=args.split)
    classes = result.classes(graph).numpy()
    scores = result.evaluate(graph)
    multilabel = classes.ndim == 2
    try:
        if out.suffix.lower() == ".npy":
            save_npy(out, classes)
        elif multilabel:
            head = "vertex," + ",".join(f"task{j}" for j in range(classes.shape[1])) + "\n"
            rows = "".join(f"{v}," + ",".join(map(str, row)) + "\n" for v, row in enumerate(classes.tolist()))
            atomic_write(out, lambda tmp: tmp.write_text(head + rows))
        else:
            text = "vertex,class\n" + "".join(f"{v},{c}\n" for v, c in enumerate(classes.tolist()))
            atomic_write(out, lambda tmp: tmp.write_text(text))
    except OSError as e:
        raise ConfigError(f"--out {os_error_line(e)}") from None
    if multilabel:
        print(
            f"wrote {out}: the 0/1 prediction of {classes.shape[1]} tasks for {len(classes):,} vertices "
            f"| {_score('test ROC-AUC', scores['test_rocauc'])}"
        )
    else:
        print(f"wrote {out}: the class of {len(classes):,} vertices | {_score('test acc', scores['test_acc'])}")
    return 0


def _score(what: str, value: float | None) -> str:
    """``what`` and its value to four decimals, or "no test split" where the split is empty."""
    return "no test split" if value is None else f"{what} {value:.4f}"
