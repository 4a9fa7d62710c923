"""Weights and checkpoints are read only with safetensors or torch.load(weights_only=True);
trust_remote_code is never switched on by flowrl itself."""
import re
from pathlib import Path

import pytest
import torch

from flowrl.checkpoints.unsharded import UnshardedCheckpoint
from flowrl.checkpoints.common import CheckpointError
from flowrl.checkpoints import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("flowrl", "pipelines", "rewards") for p in (ROOT / d).rglob("*.py")]


def test_every_torch_load_is_weights_only():
    offenders = []
    for p in SOURCES:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"torch\.load\(", line) and "weights_only=True" not in line:
                offenders.append(f"{p.relative_to(ROOT)}:{i}")
    assert SOURCES and not offenders, offenders


def test_no_trust_remote_code_on():
    hits = [str(p) for p in SOURCES if re.search(r"trust_remote_code\s*=\s*True", p.read_text())]
    assert not hits


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickled_code_in_checkpoint_is_refused(tmp_path, capsys):
    ck = UnshardedCheckpoint.save(tmp_path, 1, trainable={"w": torch.ones(1)}, optimizer={}, scheduler={}, state={})
    torch.save({"state": Evil()}, ck / "optimizer.pt")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(ck)
    assert "pwned" not in capsys.readouterr().out
