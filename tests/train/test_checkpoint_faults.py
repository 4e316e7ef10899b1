"""Checkpoints under kill -9 (one loadable checkpoint, stale temporaries removed, the resumed run equal
to an uninterrupted one, communication totals included, and under --strategy auto the same plan
without planning again), every checkpoint field checked before a
resume, and a diverging run stopped with one line and valid metrics.

The kill runs need many processes: starting one that imports torch costs seconds, so one spawned
"campaign" process imports tessera once, warms it up, and forks every training run from itself
(numba's workqueue threading layer there: GNU OpenMP's is not fork-safe). Each forked run is a real
process killed with SIGKILL. Random kills land after a random checkpoint plus a random part of an
epoch; window kills stop the process inside ``atomic_write`` (temp half written; temp complete
but not renamed; renamed but directory not yet synced) by patching the forked child only.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import select
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

from tessera.cli.main import main
from tessera.files import atomic_write, remove_stale_temps
from tessera.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.distributed  # starts worker processes

DATA = Path(__file__).parents[1] / "data"
BASE = ["train", "--dataset", "synthetic:tiny", "--hidden", "16", "--patience", "0", "--no-progress"]
KILL_ARGS = [*BASE, "--checkpoint-every", "1", "--threads", "1", "--timeout", "60"]
EPOCHS = 150  # 20 kills advance the run by at most ~6 epochs each
TEMP = re.compile(
    r"\.(checkpoint\.pt|metrics\.jsonl|metrics\.csv|config\.toml|result\.json|curves\.png)\.[a-z0-9_]{8}\.tmp"
)
STAGES = ["random"] * 8 + ["half_written", "before_rename", "after_rename"] * 4  # 20 kills


# ---------------------------------------------------------------- the campaign process
def _hold(fd: int) -> None:
    os.write(fd, b"P")  # tell the campaign where we are, then wait for SIGKILL
    time.sleep(120)
    os._exit(71)


def _instrument(fd: int, stage: str | None, at: int) -> None:
    """In a forked child: report each checkpoint save; for a window stage, stop inside save ``at``."""
    from tessera.train import loop

    save, state = loop.save_checkpoint, {"n": 0}

    def noted_save(path, ckpt):
        state["n"] += 1
        os.write(fd, b"s")
        save(path, ckpt)

    loop.save_checkpoint = noted_save

    def armed(dst) -> bool:
        return state["n"] == at and Path(dst).name == "checkpoint.pt"

    if stage == "half_written":
        real_save = torch.save

        def half_save(obj, f, *a, **k):
            real_save(obj, f, *a, **k)
            if state["n"] == at:
                os.truncate(f, os.path.getsize(f) // 2)
                _hold(fd)

        torch.save = half_save
    elif stage in ("before_rename", "after_rename"):
        real_replace = os.replace

        def replace(src, dst, *a, **k):
            if armed(dst) and stage == "after_rename":
                real_replace(src, dst, *a, **k)
            if armed(dst):
                _hold(fd)
            return real_replace(src, dst, *a, **k)

        os.replace = replace


def _fork(argv: list[str], env: dict[str, str] | None = None, stage: str | None = None, at: int = 0, err=None):
    """Fork one training process from the campaign; returns (pid, fd it reports on)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.close(r)
            os.environ.update(env or {})
            if err is not None:
                os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            _instrument(w, stage, at)
            code = main(argv)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _events(fd: int, want: bytes, count: int, timeout: float = 60.0) -> bytes:
    """Read what a child reports until ``want`` was seen ``count`` times (or it exited)."""
    got, end = b"", time.time() + timeout
    while got.count(want) < count and time.time() < end:
        if select.select([fd], [], [], max(0.0, end - time.time()))[0]:
            chunk = os.read(fd, 64)
            if not chunk:
                break
            got += chunk
    return got


def _finish(pid: int, fd: int, timeout: float = 120.0) -> int:
    """Wait for a child to exit (killing it after ``timeout``); its exit code, -9 for SIGKILL."""
    end = time.time() + timeout
    while time.time() < end and select.select([fd], [], [], max(0.0, end - time.time()))[0]:
        if not os.read(fd, 64):  # its end of the pipe closed: it exited
            break
    else:
        os.kill(pid, signal.SIGKILL)
    os.close(fd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _temps(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if TEMP.fullmatch(p.name)) if out.is_dir() else []


def _epoch(out: Path) -> int | None:
    path = out / "checkpoint.pt"
    return load_checkpoint(path)["epoch"] if path.exists() else None


def _distributed(argv: list[str], stage: str | None = None, at: int = 0, err=None, kill_after: float | None = None):
    """Two forked ranks; with a stage, rank 0 stops there (or, with ``kill_after``, both run on for
    that long after rank 0's ``at``-th save) and both are SIGKILLed. Returns the exit codes."""
    from helpers import store_socket_env

    with store_socket_env(2) as envs:  # the forks inherit the store's socket; rank 0 serves it
        procs = [_fork(argv, envs[0], stage, at, err), _fork(argv, envs[1])]
    if stage is not None or kill_after is not None:
        _events(procs[0][1], b"P" if stage else b"s", 1 if stage else at)
        time.sleep(kill_after or 0.0)
        for pid, _ in procs:
            os.kill(pid, signal.SIGKILL)
    return [_finish(pid, fd) for pid, fd in procs]


def _campaign(root: str, seed: int) -> dict:
    """Everything that forks: reference runs, 20 kills and resumes, and the distributed cases."""
    import numba

    numba.config.THREADING_LAYER = "workqueue"  # forked children may start their own pool
    root_p, rng = Path(root), random.Random(seed)

    def run(out: Path, extra=()) -> list[str]:
        return [*KILL_ARGS, "--epochs", str(EPOCHS), "--out", str(out), *extra]

    report: dict = {"trials": []}
    assert main([*KILL_ARGS, "--epochs", "2", "--out", str(root_p / "warm")]) == 0  # JIT, imports

    t0 = time.perf_counter()
    report["reference_exit"] = _finish(*_fork(run(root_p / "ref")))
    epoch_s = (time.perf_counter() - t0) / EPOCHS

    out, stale = root_p / "killed", []
    stages = STAGES.copy()
    rng.shuffle(stages)
    for stage in stages:
        at, start = rng.randint(2, 4), _epoch(out) or 0
        pid, fd = _fork(run(out, ["--resume"]), stage=None if stage == "random" else stage, at=at)
        got = _events(fd, b"s", 1)  # the first save: this start's cleanup is done
        trial = {
            "stage": stage,
            "at": at,
            "start": start,
            "stale_after_start": [n for n in stale if (out / n).exists()],
        }
        if stage == "random":
            got += _events(fd, b"s", at - got.count(b"s"))
            time.sleep(rng.uniform(0.0, 1.5 * epoch_s))
        else:
            got += _events(fd, b"P", 1)
        trial["saves_seen"], trial["held"] = got.count(b"s"), b"P" in got
        os.kill(pid, signal.SIGKILL)
        trial["exit"] = _finish(pid, fd)
        stale = _temps(out)
        trial.update(files=sorted(os.listdir(out)), temps=stale, epoch=_epoch(out))
        report["trials"].append(trial)
    report["final_exit"] = _finish(*_fork(run(out, ["--resume"])))
    report["final_files"] = sorted(os.listdir(out))

    def dist(out: Path, extra=()) -> list[str]:
        # A fixed strategy: --strategy auto's plan is measured, so two runs may choose differently
        return run(out, ["--nprocs", "2", "--strategy", "partition", "--epochs", "12", *extra])

    report["dist_reference"] = _distributed(dist(root_p / "dref"))
    dk = root_p / "dkilled"
    report["dist_window_kill"] = _distributed(dist(dk), stage="before_rename", at=rng.randint(2, 4))
    report["dist_window_kill_temps"], report["dist_window_epoch"] = _temps(dk), _epoch(dk)
    kill_after = rng.uniform(0.0, 1.5 * epoch_s)
    report["dist_random_kill"] = _distributed(dist(dk, ["--resume"]), at=rng.randint(2, 4), kill_after=kill_after)
    report["dist_random_epoch"] = _epoch(dk)
    report["dist_resume"] = _distributed(dist(dk, ["--resume"]))
    report["dist_final_files"] = sorted(os.listdir(dk))

    # --strategy auto: the reference plans (measuring) and caches its plan, which the run killed
    # next starts from; its resume, with the cache emptied, takes the plan from the checkpoint
    def auto(out: Path, extra=()) -> list[str]:
        return run(out, ["--nprocs", "2", "--strategy", "auto", "--epochs", "8", *extra])

    cache = root_p / "plans"
    os.environ["TESSERA_CACHE"] = str(cache)  # the forked ranks inherit it
    report["auto_reference"] = _distributed(auto(root_p / "aref"))
    report["auto_cached"] = sorted(os.listdir(cache / "plans"))
    ak = root_p / "akilled"
    report["auto_kill"] = _distributed(auto(ak), at=rng.randint(2, 4), kill_after=rng.uniform(0.0, 1.5 * epoch_s))
    report["auto_kill_epoch"] = _epoch(ak)
    shutil.rmtree(cache)
    report["auto_resume"] = _distributed(auto(ak, ["--resume"]))
    report["auto_cached_after_resume"] = sorted(os.listdir(cache / "plans")) if (cache / "plans").exists() else []

    old = root_p / "old"
    old.mkdir()
    shutil.copy(DATA / "checkpoint-gcn-tiny-s3-epoch4.pt", old / "checkpoint.pt")
    # The settings it was written with (the defaults, seed 3), now on two ranks.
    old_args = ["train", "--dataset", "synthetic:tiny", "--seed", "3", "--epochs", "6", "--checkpoint-every", "2"]
    old_args += ["--nprocs", "2", "--strategy", "partition", "--threads", "1", "--timeout", "60", "--no-progress"]
    report["old_resume"] = _distributed([*old_args, "--out", str(old), "--resume"], err=str(root_p / "old.err"))
    report["old_stderr"] = (root_p / "old.err").read_text()
    return report


def _campaign_entry(root: str, seed: int, conn) -> None:
    try:
        conn.send(_campaign(root, seed))
    except BaseException:
        conn.send({"error": traceback.format_exc()})


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """Run the campaign in a fresh process (not forked from pytest, whose numba pool may be GNU
    OpenMP's); the kills are random but seeded, so a failure can be replayed."""
    root = tmp_path_factory.mktemp("kills")
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_campaign_entry, args=(str(root), 15, send))
    proc.start()
    send.close()
    report = recv.recv() if recv.poll(300) else {"error": "the campaign did not report within 300 s"}
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    assert "error" not in report, report.get("error")
    return root, report


# ---------------------------------------------------------------- what the kills must leave
def _result(path: Path, drop=("epoch_time_median_s", "peak_rss_mb", "peak_rss_mb_per_rank")) -> dict:
    res = json.loads((path / "result.json").read_text())
    for k in drop:
        res.pop(k)
    res["config"] = {k: v for k, v in res["config"].items() if k not in ("out", "resume")}
    if "comm" in res:  # bytes and epoch counts are exact; times are not
        res["comm"] = {k: v for k, v in res["comm"].items() if k in ("bytes_data", "bytes_params", "epochs")}
    return res


def _strict_json(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def _metrics(path: Path) -> list[dict]:
    """Each epoch's deterministic numbers: losses, accuracies and bytes sent (not times)."""
    recs = []
    for line in (path / "metrics.jsonl").read_text().splitlines():
        r = _strict_json(line)
        rec = {k: r[k] for k in ("epoch", "train_loss", "train_acc", "val_acc", "test_acc", "val_loss")}
        if "comm" in r:
            rec["bytes"] = (r["comm"]["bytes_data"], r["comm"]["bytes_params"])
        recs.append(rec)
    return recs


def test_twenty_kill_9s_leave_one_loadable_checkpoint_and_no_temp_after_the_next_start(campaign):
    _, report = campaign
    trials = report["trials"]
    assert len(trials) == 20 and report["reference_exit"] == 0
    for i, t in enumerate(trials):
        assert t["exit"] == -signal.SIGKILL, t  # killed, not finished
        # The kill came after the trigger it waited for: the at-th save, or the stop inside it.
        assert t["held"] if t["stage"] != "random" else t["saves_seen"] >= t["at"], t
        # Exactly one checkpoint, loadable, plus metrics and our own temporaries only.
        assert t["epoch"] is not None and t["epoch"] >= t["start"], t
        assert set(t["files"]) - set(t["temps"]) - {".lock"} == {
            "checkpoint.pt",
            "config.toml",
            "metrics.csv",
            "metrics.jsonl",
        }, t
        if t["stage"] in ("half_written", "before_rename"):  # killed between temp write and rename
            assert t["epoch"] == t["start"] + t["at"] - 1 and any(
                n.startswith(".checkpoint.pt.") for n in t["temps"]
            ), t
        if t["stage"] == "after_rename":  # the rename happened: the new checkpoint is the one
            assert t["epoch"] == t["start"] + t["at"] and not t["temps"], t
        if i:  # the next start removed what the kill left
            assert t["stale_after_start"] == [], t
    assert sum(bool(t["temps"]) for t in trials) >= 8  # the 8 half-written / not-renamed kills, at least
    assert report["final_exit"] == 0
    assert report["final_files"] == ["checkpoint.pt", "config.toml", "metrics.csv", "metrics.jsonl", "result.json"]


def test_run_resumed_after_twenty_kills_equals_the_uninterrupted_run(campaign):
    root, report = campaign
    assert _result(root / "killed") == _result(root / "ref")
    assert _metrics(root / "killed") == _metrics(root / "ref")
    assert len(_metrics(root / "ref")) == EPOCHS
    assert load_checkpoint(root / "killed" / "checkpoint.pt")["epoch"] == EPOCHS


def test_two_rank_run_killed_twice_resumes_with_the_full_communication_totals(campaign):
    root, report = campaign
    assert report["dist_reference"] == [0, 0]
    assert report["dist_window_kill"] == [-signal.SIGKILL] * 2
    assert report["dist_window_kill_temps"] and report["dist_window_epoch"] >= 1
    assert report["dist_random_kill"] == [-signal.SIGKILL] * 2 and report["dist_random_epoch"] >= 1
    assert report["dist_resume"] == [0, 0]
    assert report["dist_final_files"] == ["checkpoint.pt", "config.toml", "metrics.csv", "metrics.jsonl", "result.json"]
    resumed, straight = _result(root / "dkilled"), _result(root / "dref")
    assert resumed["world_size"] == 2 and resumed["comm"]["epochs"] == 12
    assert sum(map(sum, resumed["comm"]["bytes_data"])) > 0
    assert resumed == straight
    assert _metrics(root / "dkilled") == _metrics(root / "dref")


def test_two_rank_auto_run_resumed_with_the_plan_cache_emptied_keeps_its_plan(campaign):
    root, report = campaign
    assert report["auto_reference"] == [0, 0] and len(report["auto_cached"]) == 1
    assert report["auto_kill"] == [-signal.SIGKILL] * 2 and 1 <= report["auto_kill_epoch"] < 8
    assert report["auto_resume"] == [0, 0]
    assert report["auto_cached_after_resume"] == []  # the resume planned nothing (and cached nothing)
    resumed, straight = _result(root / "akilled"), _result(root / "aref")
    plan, ref_plan = resumed.pop("plan"), straight.pop("plan")
    assert ref_plan["source"] == "measured" and plan == {
        "choices": ref_plan["choices"],
        "world": 2,
        "source": "checkpoint",
    }
    assert load_checkpoint(root / "akilled" / "checkpoint.pt")["plan"] == {"world": 2, "choices": ref_plan["choices"]}
    assert resumed["comm"]["epochs"] == 8 and sum(map(sum, resumed["comm"]["bytes_data"])) > 0
    assert resumed == straight  # losses, accuracies and bytes per layer and direction
    assert _metrics(root / "akilled") == _metrics(root / "aref")


def test_checkpoint_without_communication_records_resumes_and_says_so_once(campaign):
    root, report = campaign
    assert report["old_resume"] == [0, 0]
    notes = [s for s in report["old_stderr"].splitlines() if "communication records" in s]
    assert notes == [
        f"tessera: checkpoint {root / 'old' / 'checkpoint.pt'} has no communication records for 4 of its "
        "4 epochs; the communication totals leave those epochs out"
    ]
    res = json.loads((root / "old" / "result.json").read_text())
    assert res["epochs_run"] == 6 and res["comm"]["epochs"] == 2


# ---------------------------------------------------------------- stale temporaries
def test_stale_temp_removal_takes_only_atomic_writes_own_names(tmp_path):
    target = tmp_path / "checkpoint.pt"
    seen = []
    atomic_write(target, lambda tmp: (seen.append(tmp.name), tmp.write_bytes(b"x")))
    ours = [seen[0], ".checkpoint.pt.abcd_123.tmp"]  # the name atomic_write really chose, and another
    others = [
        ".checkpoint.pt.abc.tmp",
        ".checkpoint.pt.ABCD1234.tmp",
        ".checkpoint.pt.abcd1234.tmp.bak",
        "checkpoint.pt.abcd1234.tmp",
        ".result.json.abcd1234.tmp",
        ".checkpoint.ptx.abcd1234.tmp",
    ]
    for name in ours + others:
        (tmp_path / name).write_text("stale")
    (tmp_path / ".checkpoint.pt.dir12345.tmp").mkdir()
    removed = remove_stale_temps(target)
    assert sorted(p.name for p in removed) == sorted(ours)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["checkpoint.pt", ".checkpoint.pt.dir12345.tmp", *others])
    assert target.read_bytes() == b"x"


@pytest.mark.parametrize("moment", ["created", "closed", "writing"])
def test_a_stop_signal_at_any_moment_of_atomic_write_leaves_no_temporary(moment, tmp_path, monkeypatch):
    # a signal handler raises Stopped at the next bytecode: right after the O_EXCL open made the
    # file, right after its descriptor closed, or inside write(); each must leave nothing behind
    import tessera.files as files
    from tessera.cli.watch import Stopped

    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"old")
    real_open, real_close = os.open, os.close

    def stop_after(real, when):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            if moment == when and str(args[0]).endswith(".tmp"):
                raise Stopped(signal.SIGHUP)
            return result

        return call

    def close(fd):
        real_close(fd)
        if moment == "closed":
            raise Stopped(signal.SIGHUP)

    monkeypatch.setattr(files.os, "open", stop_after(real_open, "created"))
    monkeypatch.setattr(files.os, "close", close)

    def write(tmp):
        tmp.write_bytes(b"half")
        raise Stopped(signal.SIGHUP)

    with pytest.raises(Stopped):
        atomic_write(target, write)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert target.read_bytes() == b"old"


# ---------------------------------------------------------------- checkpoint fields
@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("good")
    assert main([*BASE, "--epochs", "3", "--out", str(out)]) == 0
    return out


def _break(ck: dict, case: str) -> None:
    model = ck["model"]
    w = "convs.0.lin.weight"
    if case == "missing key":
        del ck["optimizer"]
    elif case == "missing nested key":
        del ck["optimizer"]["state"][1]["exp_avg_sq"]
    elif case == "missing model tensor":
        del model[w]
    elif case == "wrong type":
        ck["epoch"] = "3"
    elif case == "wrong type nested":
        ck["history"][1]["train_loss"] = [1.0]
    elif case == "wrong tensor shape":
        model[w] = torch.zeros(3, 3)
    elif case == "wrong optimizer shape":
        ck["optimizer"]["state"][0]["exp_avg"] = torch.zeros(7)
    elif case == "wrong best shape":
        ck["best"]["state"]["convs.1.lin.weight"] = model["convs.1.lin.weight"].t().contiguous()
    elif case == "wrong dtype":
        model[w] = model[w].double()
    elif case == "wrong rng dtype":
        ck["rng"] = ck["rng"].long()
    elif case == "extra garbage":
        ck["garbage"] = torch.zeros(3)
    elif case == "extra model tensor":
        model["junk.weight"] = torch.zeros(2)
    elif case == "extra optimizer group setting":
        ck["optimizer"]["param_groups"][0]["momentum"] = 0.9
    elif case == "optimizer group setting changed":
        ck["optimizer"]["param_groups"][0]["betas"] = (0.5, 0.5)
    elif case == "optimizer state of no parameter":
        ck["optimizer"]["state"][99] = ck["optimizer"]["state"][0]
    elif case == "history shorter than epoch":
        ck["history"].pop()
    elif case == "nan in history":
        ck["history"][0]["val_loss"] = float("nan")
    elif case == "best epoch after epoch":
        ck["best"]["epoch"] = 9
    elif case == "bad comm record":
        ck["history"][0]["comm"] = {"bytes_data": [1, 2]}
    elif case == "config value a tensor":
        ck["config"]["hidden"] = torch.zeros(2)
    elif case == "step not a scalar":
        ck["optimizer"]["state"][0]["step"] = torch.zeros(2)
    elif case == "plan not a dict":
        ck["plan"] = ["tensor", "tensor"]
    elif case == "plan without choices":
        ck["plan"] = {"world": 2}
    elif case == "plan of one rank":
        ck["plan"] = {"world": 1, "choices": ["tensor", "tensor"]}
    elif case == "plan for other layers":
        ck["plan"] = {"world": 2, "choices": ["tensor"]}
    elif case == "plan entry unknown":
        ck["plan"] = {"world": 2, "choices": ["tensor:32", "nosuch"]}
    elif case == "plan entry not a string":
        ck["plan"] = {"world": 2, "choices": ["tensor:32", 7]}
    elif case == "plan M not dividing world":
        ck["plan"] = {"world": 3, "choices": ["hybrid:2:post:32", "tensor:32"]}
    else:
        raise AssertionError(case)


CASES = {
    "missing key": "field 'optimizer' is missing",
    "missing nested key": "field 'optimizer'['state'][1]['exp_avg_sq'] is missing",
    "missing model tensor": "field 'model'['convs.0.lin.weight'] is missing",
    "wrong type": "field 'epoch' is a str, expected int",
    "wrong type nested": "field 'history'[1]['train_loss'] is [1.0], expected a finite number",
    "wrong tensor shape": "field 'model'['convs.0.lin.weight'] has shape (3, 3), but the model being built needs (16, 16)",
    "wrong optimizer shape": "field 'optimizer'['state'][0]['exp_avg'] has shape (7,)",
    "wrong best shape": "field 'best'['state']['convs.1.lin.weight'] has shape (16, 4), but the model being built needs (4, 16)",
    "wrong dtype": "has dtype torch.float64, but the model being built needs torch.float32",
    "wrong rng dtype": "field 'rng' has dtype torch.int64",
    "extra garbage": "field 'garbage' is not a checkpoint field",
    "extra model tensor": "field 'model'['junk.weight'] is not a checkpoint field",
    "extra optimizer group setting": "['momentum'] is not a checkpoint field",
    "optimizer group setting changed": "['betas'] is (0.5, 0.5), but this run's optimizer has (0.9, 0.999)",
    "optimizer state of no parameter": "field 'optimizer'['state'][99] names no parameter",
    "history shorter than epoch": "field 'history' has 2 records for 3 epochs",
    "nan in history": "field 'history'[0]['val_loss'] is nan, expected a finite number",
    "best epoch after epoch": "field 'best'['epoch'] is 9, expected 0 to 3",
    "bad comm record": "field 'history'[0]['comm'] must be a dict with exactly the keys",
    "config value a tensor": "field 'config'['hidden'] is a Tensor, expected a setting's value",
    "step not a scalar": "['step'] is tensor([0., 0.]), expected a finite step count",
    "not a dict": "holds a list, not a tessera checkpoint",
    "plan not a dict": "field 'plan' is a list, expected dict",
    "plan without choices": "field 'plan'['choices'] is missing",
    "plan of one rank": "field 'plan'['world'] is 1, expected 2 to",
    "plan for other layers": "field 'plan'['choices'] has 1 entries, but the model has 2 layers",
    "plan entry unknown": "field 'plan'['choices'][1] is 'nosuch', not an entry for 2 ranks (unknown --strategy entry",
    "plan entry not a string": "field 'plan'['choices'][1] is a int, expected str",
    "plan M not dividing world": "field 'plan'['choices'][0] is 'hybrid:2:post:32', not an entry for 3 ranks "
    "(--groups 2 does not divide the 3 ranks",
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_field_is_one_line_and_touches_nothing(good_run, tmp_path, capsys, case):
    out = tmp_path / "run"
    shutil.copytree(good_run, out)
    ck = load_checkpoint(out / "checkpoint.pt")
    if case == "not a dict":
        ck = [ck["epoch"], ck["model"]]
    else:
        _break(ck, case)
    torch.save(ck, out / "checkpoint.pt")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main([*BASE, "--epochs", "5", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("tessera: error: checkpoint "), err
    assert CASES[case] in err[0] and err[0].endswith("; delete the checkpoint or drop --resume"), err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_plan_in_a_placement_its_layer_cannot_run_is_refused():
    from tessera.errors import TesseraError
    from tessera.nn import build_model
    from tessera.train.checkpoint import check_plan

    gin = build_model("gin", 4, 8, 2, 2)  # GIN aggregates its input, never after its MLP
    plan = {"world": 2, "choices": ["tensor:32", "partition:post:32@transform-first"]}
    with pytest.raises(TesseraError, match=r"field 'plan'\['choices'\]\[1\] is .*, a placement layer 1 cannot run"):
        check_plan({"plan": plan}, "ck.pt", gin)
    plan["choices"][1] = "partition:post:32@aggregate-first"  # its own placement
    assert check_plan({"plan": plan}, "ck.pt", gin) is plan and check_plan({"plan": None}, "ck.pt", gin) is None


def test_resume_without_a_checkpoint_says_it_starts_afresh(tmp_path, capsys):
    out = tmp_path / "fresh"
    assert main([*BASE, "--epochs", "2", "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"tessera: no checkpoint in {out}; starting from epoch 1"]
    assert load_checkpoint(out / "checkpoint.pt")["epoch"] == 2


# ---------------------------------------------------------------- divergence
def test_diverging_run_stops_with_one_line_and_leaves_valid_metrics_and_no_result(tmp_path, capsys):
    out = tmp_path / "nan"
    # Adam moves every weight by about lr per step: at 1e18 the logits overflow float32 within epochs.
    assert main([*BASE, "--epochs", "30", "--lr", "1e18", "--checkpoint-every", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    m = re.fullmatch(
        r"tessera: error: training diverged at epoch (\d+): the (training|validation) loss is (nan|inf|-inf); "
        r"lower --lr \(now 1e\+18\) and train again without --resume",
        err[0],
    )
    assert m, err[0]
    epoch = int(m.group(1))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [_strict_json(s)["epoch"] for s in lines] == list(range(1, epoch))
    assert not (out / "result.json").exists() and not _temps(out)
    if epoch > 1:  # the last checkpoint is the last finite epoch
        assert load_checkpoint(out / "checkpoint.pt")["epoch"] == epoch - 1


def test_non_finite_value_never_reaches_a_json_file(tmp_path):
    from tessera.files import write_json

    with pytest.raises(ValueError):
        write_json(tmp_path / "x.json", {"loss": float("nan")})
    assert list(tmp_path.iterdir()) == []


if __name__ == "__main__":  # replay a campaign by hand: python tests/test_checkpoint_faults.py DIR [SEED]
    found = _campaign(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 15)
    Path(sys.argv[1], "report.json").write_text(json.dumps(found, indent=1))
