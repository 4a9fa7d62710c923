"""The README's pretraining table is the report of the run that produced it
(:func:`flowrl.digits_report.readme_table` of the digits base's ``report.json``)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flowrl.digits_report import REPORT_JSON, readme_table

README = Path(__file__).resolve().parents[1] / "README.md"
SOURCE = re.compile(r"<!-- from report.json of the digits base with pretrain.json final_loss ([0-9.]+) ")


def _record(final_loss=0.2011361, acc1=0.9, rew1=0.8662, **report):
    return {"pretrain": json.dumps({"steps_done": 600, "final_loss": final_loss}),
            "report": {"guidance_1": {"accuracy": acc1, "reward": rew1},
                       "guidance_3": {"accuracy": 1.0, "reward": 0.99583}, "grid": "x.png", **report}}


def test_the_table_is_written_from_the_report():
    lines = readme_table(_record(samples=40, ode_steps=8)).splitlines()
    assert SOURCE.match(lines[0]) and SOURCE.match(lines[0]).group(1) == "0.201136"
    assert lines[1] == "| base model (600 steps), 8-step ODE, 40 samples | classifier accuracy | `digits` reward |"
    assert lines[3:] == ["| guidance 1.0 | 0.900 | 0.866 |", "| guidance 3.0 | 1.000 | 0.996 |"]
    assert "20-step ODE, 160 samples" in readme_table(_record())  # a report from before it recorded its sizes


def test_readme_table_matches_the_report_it_names():
    from flowrl.pipelines.digits import default_base_path

    text = README.read_text()
    named = SOURCE.search(text)
    assert named, "README.md lost the comment naming the report its pretraining table comes from"
    path = default_base_path() / REPORT_JSON
    if not path.is_file():
        pytest.skip(f"no digits report at {path} (flowrl pretrain-digits writes it)")
    record = json.loads(path.read_text())
    loss = json.loads(record["pretrain"])["final_loss"] if record.get("pretrain") else None
    if loss is None or f"{loss:.6f}" != named.group(1):
        pytest.skip(f"the digits base at {path.parent} (final_loss {loss}) is not the one the README's table comes "
                    f"from (final_loss {named.group(1)})")
    assert readme_table(record) in text
