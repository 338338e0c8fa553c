"""Running llamafactory-cli: streaming, failure text, the child dying with us, and when a training folder resumes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.sft import runner


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_launch_streams_output_and_keeps_a_log(tmp_path):
    console = io.BytesIO()
    code = "import sys, time\nfor i in range(3):\n    print(f'step {i}', flush=True)\nsys.stdout.write('50%\\r100%\\n')"
    runner.launch(python(code), dict(os.environ), tmp_path / "train.log", console=console)
    assert console.getvalue() == b"step 0\nstep 1\nstep 2\n50%\r100%\n"
    log = (tmp_path / "train.log").read_bytes()
    assert log.startswith(b"$ ") and log.endswith(console.getvalue())


def test_a_failure_carries_the_traceback_not_the_progress_bars(tmp_path):
    code = (
        "import sys\n"
        "for i in range(200):\n    sys.stdout.write(f'\\r{i}/200 steps')\n"
        "print()\n"
        "print('[INFO] loading things', flush=True)\n"
        "raise ValueError('Image features and image tokens do not match: tokens: 10, features 12')\n"
    )
    with pytest.raises(runner.TrainingFailed) as err:
        runner.launch(python(code), dict(os.environ), tmp_path / "log", console=io.BytesIO())
    message = str(err.value)
    assert err.value.returncode == 1 and "failed (exit code 1)" in message
    assert "Traceback (most recent call last)" in message and "ValueError: Image features and image tokens" in message
    assert "199/200" not in message and "[INFO] loading things" not in message  # from the traceback on only
    assert str(tmp_path / "log") in message


def test_error_tail_without_traceback_keeps_the_last_state_of_each_line():
    output = b"\x1b[31mred\x1b[0m\n" + b"".join(f"\r{i}%".encode() for i in range(101)) + b"\nKilled\n"
    assert runner.error_tail(output) == "red\n100%\nKilled"


def test_under_torchrun_the_rank_s_error_is_kept_not_torchrun_s():
    output = (b"[INFO] step 3\nTraceback (most recent call last):\n  File \"launcher.py\", line 9\n"
              b"ValueError: Image features and image tokens do not match\n[rank1] exiting\n"
              b"Traceback (most recent call last):\n  File \"run.py\", line 3\n"
              b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\nlauncher.py FAILED\n")
    tail = runner.error_tail(output)
    assert tail.startswith("Traceback") and tail.endswith("[rank1] exiting")
    assert "ValueError: Image features" in tail and "ChildFailedError" not in tail


def test_a_signal_death_is_reported_as_such(tmp_path):
    with pytest.raises(runner.TrainingFailed, match="killed by signal 9"):
        runner.launch(python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), dict(os.environ),
                      tmp_path / "log", console=io.BytesIO())


def test_the_child_dies_when_the_stage_is_killed(tmp_path):
    """A stage killed by a scheduler must not leave a trainer writing checkpoints behind it."""
    pid_file = tmp_path / "child.pid"
    child_code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    stage = (
        "import os, sys, pathlib\n"
        "from stages.sft import runner\n"
        f"runner.launch([sys.executable, '-c', {child_code!r}], dict(os.environ), pathlib.Path({str(tmp_path / 'log')!r}))\n"
    )
    process = subprocess.Popen(python(stage), cwd=Path(__file__).parents[1], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not pid_file.is_file() or not pid_file.read_text():
        assert process.poll() is None and time.monotonic() < deadline, "the child never started"
        time.sleep(0.1)
    child = int(pid_file.read_text())
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the child outlived the stage"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.is_file() and status.read_text().split()[2] != "Z"  # a zombie has exited


def test_child_environment_points_llamafactory_at_our_run(monkeypatch):
    monkeypatch.setenv("MLFLOW_NESTED_RUN", "true")
    env = runner.child_environment("abc123", "sqlite:///x.db", force_torchrun=True)
    assert env["MLFLOW_RUN_ID"] == "abc123" and env["MLFLOW_TRACKING_URI"] == "sqlite:///x.db"
    assert "MLFLOW_NESTED_RUN" not in env and env["FORCE_TORCHRUN"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    off = runner.child_environment(None, None)
    assert "MLFLOW_RUN_ID" not in off and "FORCE_TORCHRUN" not in off
    assert runner.child_environment(None, None, launch={"OMP_NUM_THREADS": "1"})["OMP_NUM_THREADS"] == "1"


def test_several_cpu_processes_train_under_torchrun_and_the_yaml_says_how():
    one = runner.llamafactory_command("train", Path("/r/train.yaml"))
    assert one[1:] == ["-m", "llamafactory.cli", "train", "/r/train.yaml"]
    assert runner.by_hand(one) == "llamafactory-cli train /r/train.yaml"
    two = runner.llamafactory_command("train", Path("/r/train.yaml"), processes=2)
    assert two[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert two[5].endswith("llamafactory/launcher.py") and Path(two[5]).is_file() and two[6] == "/r/train.yaml"
    assert runner.by_hand(two, {"OMP_NUM_THREADS": "1"}).startswith("OMP_NUM_THREADS=1 torchrun --standalone")
    # Export is one process whatever the training was.
    assert runner.llamafactory_command("export", Path("/r/e.yaml"), processes=2)[2] == "llamafactory.cli"


# --- the training folder ---------------------------------------------------------------------------------


def checkpoint(train_dir: Path, step: int, complete: bool = True) -> Path:
    path = train_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w")
    if complete:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def test_fresh_folder_gets_a_fingerprint(tmp_path):
    state = runner.prepare_train_dir(tmp_path / "train", "abc")
    assert state.kind == "fresh" and state.step == 0
    assert json.loads((tmp_path / "train" / runner.FINGERPRINT_FILE).read_text()) == {"fingerprint": "abc"}


def test_same_inputs_resume_from_the_last_complete_checkpoint(tmp_path):
    train = tmp_path / "train"
    runner.prepare_train_dir(train, "abc")
    checkpoint(train, 5)
    checkpoint(train, 10)
    checkpoint(train, 15, complete=False)  # killed while saving
    state = runner.prepare_train_dir(train, "abc")
    assert (state.kind, state.step) == ("resume", 10)
    assert not (train / "checkpoint-15").exists() and (train / "checkpoint-10").exists()


def test_other_inputs_start_over(tmp_path):
    train = tmp_path / "train"
    runner.prepare_train_dir(train, "abc")
    checkpoint(train, 10)
    state = runner.prepare_train_dir(train, "xyz")
    assert state.kind == "fresh" and "another config" in state.note
    assert not (train / "checkpoint-10").exists()


def test_a_finished_folder_is_done_and_a_half_saved_one_starts_over(tmp_path):
    train = tmp_path / "train"
    runner.prepare_train_dir(train, "abc")
    (train / "model.safetensors").write_bytes(b"w")
    (train / "train_results.json").write_text("{}")
    assert runner.prepare_train_dir(train, "abc").kind == "done"
    (train / "train_results.json").unlink()  # the final save was cut off, and there is no checkpoint
    state = runner.prepare_train_dir(train, "abc")
    assert state.kind == "fresh" and not (train / "model.safetensors").exists()


def test_fingerprint_follows_dataset_and_model(tmp_path):
    data, image, model = tmp_path / "data.json", tmp_path / "a.png", tmp_path / "model"
    data.write_text("[1]")
    image.write_bytes(b"png")
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"12345")
    base = runner.fingerprint({"lr": 1}, [data], [image], model)
    assert base == runner.fingerprint({"lr": 1}, [data], [image], model)
    assert base != runner.fingerprint({"lr": 2}, [data], [image], model)
    data.write_text("[2]")
    changed_data = runner.fingerprint({"lr": 1}, [data], [image], model)
    (model / "model.safetensors").write_bytes(b"123456")
    resized = runner.fingerprint({"lr": 1}, [data], [image], model)
    (model / "model.safetensors").write_bytes(b"654321")  # retrained at the same shape: same size, new weights
    assert len({base, changed_data, resized, runner.fingerprint({"lr": 1}, [data], [image], model)}) == 4


def test_fingerprint_sees_weights_changed_far_inside_a_large_file(tmp_path, monkeypatch):
    """The samples are the start, the middle and the end of each weight file: a change in the middle of a file
    larger than all three samples together changes the fingerprint, as a retrained model's weights do."""
    monkeypatch.setattr(runner, "WEIGHT_SAMPLE", 4)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = bytearray(b"a" * 64)
    (model / "model.safetensors").write_bytes(bytes(weights))
    before = runner.fingerprint({}, [], [], model)
    weights[31] = ord("b")
    (model / "model.safetensors").write_bytes(bytes(weights))
    assert runner.fingerprint({}, [], [], model) != before
