"""The README's pretraining table is the report of the run that produced it
(:func:`flowrl.digits_report.readme_table` of the digits base's ``report.json``, kept as
``docs/digits_base_report.json``), and a pretrained base yields such a table."""
from __future__ import annotations

import json
import re
from pathlib import Path

from flowrl.digits_report import REPORT_JSON, readme_table

README = Path(__file__).resolve().parents[1] / "README.md"
BASE_REPORT = README.parent / "docs" / "digits_base_report.json"  # the report.json the README's table comes from
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
    """The README's table is :func:`readme_table` of the report it names, kept in docs/ (a base pretrained on
    another machine differs by a few points, so the record is committed, not re-measured)."""
    text = README.read_text()
    named = SOURCE.search(text)
    assert named, "README.md lost the comment naming the report its pretraining table comes from"
    record = json.loads(BASE_REPORT.read_text())
    assert f"{json.loads(record['pretrain'])['final_loss']:.6f}" == named.group(1)
    assert readme_table(record) in text
    assert BASE_REPORT.name in text  # the README says where its table comes from


def test_a_pretrained_base_reports_a_readme_table(tmp_path):
    """The path the table comes from runs end to end on a tiny base: pretraining, the sample report
    (cached beside the model), the README table of its record."""
    import torch

    from flowrl.digits_report import sample_grid_report
    from flowrl.pipelines.digits import PretrainConfig, pretrain_digits

    with torch.inference_mode():
        pretrain_digits(tmp_path, PretrainConfig(steps=2, batch_size=4), progress=False)
    report = sample_grid_report(tmp_path, tmp_path / "samples.png", per_digit=1, num_steps=2)
    record = {"pretrain": (tmp_path / "pretrain.json").read_text(), "report": report}
    lines = readme_table(record).splitlines()
    assert SOURCE.match(lines[0]) and lines[1].startswith("| base model (2 steps), 2-step ODE, 10 samples |")
    assert [ln.split("|")[1].strip() for ln in lines[3:]] == ["guidance 1.0", "guidance 3.0"]
    assert all(0 <= float(v) <= 1 for ln in lines[3:] for v in ln.split("|")[2:4])
    assert (tmp_path / "samples.png").is_file()
