"""Record, or compare against a record, the per-epoch losses of `tessera train` for each model.

A refactor that must change no behaviour runs this before (``--write FILE``) and after
(``--check FILE``): losses must match bit for bit (their float64 ``repr``). It trains through the
CLI, as a user does: GCN, SAGE, SAGE-LSTM, GIN, GAT on ``synthetic:small``, RGCN on
``synthetic:small-rel``, and GCN and GAT with ``--nprocs 2``; then resumes a checkpoint written by
the recorded run (``--resume`` of the saved GCN run to more epochs), so an old checkpoint is proved
readable by the new code.

    python benchmarks/same_losses.py --write /tmp/losses.json --keep /tmp/runs-before
    python benchmarks/same_losses.py --check /tmp/losses.json --resume-from /tmp/runs-before
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "gcn": ["--model", "gcn"],
    "sage": ["--model", "sage"],
    "sage-lstm": ["--model", "sage-lstm", "--hidden", "32"],
    "gin": ["--model", "gin"],
    "gat": ["--model", "gat"],
    "rgcn": ["--model", "rgcn", "--dataset", "synthetic:small-rel"],
    "gcn-np2": ["--model", "gcn", "--nprocs", "2"],
    "gat-np2": ["--model", "gat", "--nprocs", "2"],
}
EPOCHS = 6


def train(args: list[str], out: Path) -> list[str]:
    """Run ``tessera train`` into ``out``; the losses of its epochs as exact float reprs."""
    cmd = [sys.executable, "-m", "tessera", "train", "--dataset", "synthetic:small", "--epochs", str(EPOCHS)]
    cmd += ["--threads", "1", "--no-progress", "--patience", "0", "--out", str(out), *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return losses(out)


def losses(out: Path) -> list[str]:
    """Each epoch's training and validation loss in ``out/metrics.jsonl``, as exact float reprs."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [f"{float(r['train_loss'])!r} {float(r['val_loss'])!r}" for r in rows if "train_loss" in r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="record the losses here")
    ap.add_argument("--check", type=Path, help="compare with the losses recorded here")
    ap.add_argument("--keep", type=Path, help="keep the run directories here (for --resume-from later)")
    ap.add_argument("--resume-from", type=Path, help="run directories of the recorded runs: resume their GCN run")
    a = ap.parse_args()
    root = a.keep or Path(tempfile.mkdtemp())
    root.mkdir(parents=True, exist_ok=True)
    got = {name: train(args, root / name) for name, args in RUNS.items()}
    if a.resume_from is not None:
        old = root / "gcn-resumed"
        shutil.rmtree(old, ignore_errors=True)
        shutil.copytree(a.resume_from / "gcn", old)
        cmd = [sys.executable, "-m", "tessera", "train", "--dataset", "synthetic:small", "--model", "gcn"]
        cmd += ["--epochs", str(EPOCHS + 4), "--threads", "1", "--no-progress", "--patience", "0"]
        cmd += ["--checkpoint-every", "1", "--resume", "--out", str(old)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        got["gcn-resumed"] = losses(old)
    if a.write:
        a.write.write_text(json.dumps(got, indent=1))
    if a.check:
        want = json.loads(a.check.read_text())
        bad = [k for k in want if k in got and got[k] != want[k]]
        for k in bad:
            print(f"{k}: recorded {want[k]}\n{'':{len(k)}}  now      {got[k]}")
        if "gcn-resumed" in got:
            print(f"gcn-resumed: {len(got['gcn-resumed'])} epochs, the last {got['gcn-resumed'][-1]}")
        print(f"{len(want) - len(bad)} of {len(want)} runs bitwise equal")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
