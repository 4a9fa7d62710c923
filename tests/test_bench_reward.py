"""`flowrl bench reward` at a tiny budget (the judge variants: a stub judge, no OCR engine): the JSON
it writes and its bit-identity checks. Timings are the benchmark's to report, not asserted here."""
import json

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_reward_judge_variants_smoke(tmp_path, capsys):
    from flowrl.cli import main

    assert main(["bench", "reward", "--resolution", "32", "--prompts", "1", "--group-size", "2", "--num-steps", "2",
                 "--max-batch", "1", "--iterations", "1", "--judge-delay", "0.01", "--variants", "judge_serial",
                 "judge_overlap", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "reward.json").read_text())
    assert set(out["variants"]) == {"judge_serial", "judge_overlap"}
    assert out["checks"] == {"judge_overlap_rewards_equal_judge_serial": True}
    for name, r in out["variants"].items():
        assert len(r["per_iteration"]) == 1 and len(r["rewards"]) == 2  # warm-up + 1 timed
        assert r["reward_seconds"] > 0 and r["update_seconds"] > 0 and r["speedup_vs_serial"] > 0
    assert out["settings"]["judge_delay_seconds"] == 0.01 and out["machine"]["cores"] >= 1
    assert "judge_overlap" in capsys.readouterr().out
    assert main(["bench", "reward", "--variants", "nope", "--out", str(tmp_path)]) == 2  # a one-line error
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown variant(s) ['nope']" in err and "judge_overlap" in err
