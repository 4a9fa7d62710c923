"""What flowrl leaves behind: progress as plain lines in a log, weights readable by the team (the
umask's bits, not safetensors' 0600), benchmark files only where asked, the digits report measured
once per model."""
import io
import json
import os
import stat

import pytest
import torch

from flowrl.utils.io import atomic_dir, atomic_write, share_permissions
from flowrl.utils.progress import PlainProgress, progress


def test_plain_progress_writes_lines_not_carriage_returns():
    out = io.StringIO()
    bar = PlainProgress(range(5), initial=0, desc="flowrl train", every_seconds=0.0, stream=out)
    for i in bar:
        bar.set_postfix(reward=f"{i / 10:.3f}")
    text = out.getvalue()
    assert "\r" not in text and text.count("\n") == 6  # one line per update, then the closing line
    assert text.splitlines()[-1].startswith("flowrl train: 5/5 (100%), ") and "reward=0.400" in text


def test_plain_progress_is_quiet_between_periods():
    out = io.StringIO()
    bar = PlainProgress(total=1000, initial=10, desc="generate groups", every_seconds=3600, stream=out)
    for _ in range(990):
        bar.update()
    bar.close()
    assert out.getvalue().splitlines() == [bar.line()] and bar.line().startswith("generate groups: 1000/1000 (100%)")


def test_progress_picks_by_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert isinstance(progress(range(3), desc="x"), PlainProgress)
    monkeypatch.setattr("sys.stderr", Tty())
    assert not isinstance(progress(range(3), desc="x"), PlainProgress)  # tqdm on a terminal
    assert not isinstance(progress(range(3), disable=True), PlainProgress)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_safetensors_written_atomically_are_team_readable(tmp_path, umask_022):
    from safetensors.torch import save_file

    f = atomic_write(tmp_path / "w.safetensors", lambda tmp: save_file({"a": torch.ones(2)}, str(tmp)))
    assert stat.S_IMODE(f.stat().st_mode) == 0o644

    def model(tmp):
        tmp.mkdir()
        save_file({"a": torch.ones(2)}, str(tmp / "diffusion_pytorch_model.safetensors"))
    d = atomic_dir(tmp_path / "model", model)
    assert stat.S_IMODE((d / "diffusion_pytorch_model.safetensors").stat().st_mode) == 0o644


def test_share_permissions_adds_only_what_the_umask_allows(tmp_path):
    f = tmp_path / "x"
    f.write_text("x")
    os.chmod(f, 0o700)
    old = os.umask(0o077)
    try:
        share_permissions(f)
        assert stat.S_IMODE(f.stat().st_mode) == 0o700  # a private umask keeps it private
        os.umask(0o022)
        share_permissions(tmp_path)
        assert stat.S_IMODE(f.stat().st_mode) == 0o744  # read bits added, the execute bit kept
    finally:
        os.umask(old)


def test_checkpoint_files_are_team_readable(tmp_path, umask_022):
    from flowrl.checkpoints.unsharded import UnshardedCheckpoint

    ck = UnshardedCheckpoint.save(tmp_path / "ck", 1, trainable={"w": torch.ones(2)}, optimizer={}, scheduler={}, state={},
                         ema={"w": torch.ones(2)})
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in ck.iterdir()} == dict.fromkeys(
        ["trainable.safetensors", "ema.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"], 0o644)


def test_digits_report_is_measured_once_per_model(tmp_path, monkeypatch, capsys):
    import flowrl.digits_report as R

    calls = []

    def fake(path, grid, **kw):
        calls.append(path)
        grid.write_bytes(b"png")
        return {"guidance_1": {"accuracy": 0.5}, "grid": str(grid)}
    monkeypatch.setattr(R, "sample_grid_report", fake)
    (tmp_path / "pretrain.json").write_text('{"seconds": 1}')
    first = R.cached_report(tmp_path)
    assert R.cached_report(tmp_path) == first and len(calls) == 1  # reused
    assert "cached" in capsys.readouterr().out
    R.cached_report(tmp_path, force=True)
    (tmp_path / "pretrain.json").write_text('{"seconds": 2}')  # a retrained model: measured again
    R.cached_report(tmp_path)
    assert len(calls) == 3


def test_benches_write_files_only_where_asked(tmp_path, monkeypatch, capsys):
    from flowrl.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["bench", "host", "--pipeline", "digits", "--device", "cpu", "--num-steps", "1", "--prompts", "1",
                 "--group-size", "2", "--no-update"]) == 0
    cap = capsys.readouterr()
    assert list(tmp_path.iterdir()) == []  # no bench_host.json in the working directory
    assert cap.out.startswith("flowrl bench host: digits on cpu") and "No CUDA runtime" not in cap.err
    assert main(["bench", "host", "--pipeline", "digits", "--device", "cpu", "--num-steps", "1", "--prompts", "1",
                 "--group-size", "2", "--no-update", "--json", "out/host.json"]) == 0
    assert json.loads((tmp_path / "out" / "host.json").read_text())["options"]["pipeline"] == "digits"
    assert "wrote out/host.json" in capsys.readouterr().err  # status on stderr, the table alone on stdout
