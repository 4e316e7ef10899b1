"""``--device``: a device the machine lacks, or a malformed one, is a one-line error before
anything is loaded, launched or written; ``auto`` and ``cpu`` train on the CPU here."""

import json

import pytest
import torch

from tessera.cli.main import main
from tessera.devices import check_device_setting, resolve_device, training_device
from tessera.errors import ConfigError

NO_GPU = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cuda"], "--device cuda: this machine has no CUDA device"),
        (["--device", "cuda:1"], "--device cuda:1: this machine has no CUDA device"),
        (["--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (["--device", "cpu:0"], "--device must be auto, cpu, cuda or cuda:N, got 'cpu:0'"),
        (["--device", "cuda", "--nprocs", "2"], "--device cuda: 2 ranks on this node need a GPU each, but it has 0"),
        (["--device", "cuda:1", "--nprocs", "2"], "each rank takes its own GPU (cuda:LOCAL_RANK); use --device cuda"),
    ],
)
def test_a_device_this_machine_lacks_is_one_line_exit_2_and_no_files(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    assert main(["train", "--dataset", "synthetic:tiny", "--epochs", "1", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessera: error: ") and message in err[0], err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_the_device_is_read_from_a_config_file_and_checked_there(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('device = "tpu"\n')
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    assert "--device must be auto, cpu, cuda or cuda:N, got 'tpu'" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_auto_and_cpu_train_on_the_cpu_here(tmp_path, capsys, device):
    out = tmp_path / device
    argv = ["train", "--dataset", "synthetic:tiny", "--epochs", "2", "--hidden", "8", "--no-progress"]
    assert main([*argv, "--device", device, "--out", str(out)]) == 0
    capsys.readouterr()
    assert json.loads((out / "result.json").read_text())["config"]["device"] == device


def test_settings_resolve_as_documented(monkeypatch):
    for ok in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert check_device_setting(ok) == ok
    for bad in ("", "CUDA", "cuda:", "cuda:x", "auto:0", "mps"):
        with pytest.raises(ConfigError, match="--device must be"):
            check_device_setting(bad)
    assert resolve_device("cpu") == torch.device("cpu")
    assert training_device("auto", distributed=True) == torch.device("cpu")
    # a node with two GPUs: cuda is this rank's LOCAL_RANK; an index past the last is refused
    monkeypatch.setattr("tessera.devices.cuda_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"asks for CUDA device 2 but this node has 2 \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ConfigError, match=r"local rank 3 \(--device cuda\) asks for CUDA device 3"):
        resolve_device("cuda")


def test_each_rank_of_a_distributed_run_takes_its_own_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert training_device("auto", distributed=True) == torch.device("cpu")  # no GPU here
    monkeypatch.setattr("tessera.devices.cuda_count", lambda: 1)
    assert training_device("auto", distributed=True) == torch.device("cpu")  # one GPU, two ranks: the CPU
    with pytest.raises(ConfigError, match="2 ranks on this node need a GPU each, but it has 1"):
        training_device("cuda", distributed=True)
    monkeypatch.setattr("tessera.devices.cuda_count", lambda: 2)
    assert training_device("auto", distributed=True) == training_device("cuda", True) == torch.device("cuda", 1)
    assert training_device("cpu", distributed=True) == torch.device("cpu")
    with pytest.raises(ConfigError, match="each rank takes its own GPU"):
        training_device("cuda:0", distributed=True)
    # the launcher checks before it starts its ranks, for the ranks it will start
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match="4 ranks on this node need a GPU each, but it has 2"):
        training_device("cuda", distributed=True, ranks_here=4)
