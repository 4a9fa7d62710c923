"""End to end on the real (pretrained) digits base: GRPO raises the held-out reward."""
import json

from flowrl.trainers.config import load_config
from flowrl.trainers.online import train


def test_grpo_raises_digits_reward(pretrained_digits_base, tmp_path):
    cfg = load_config("recipes/digits.yaml", [
        "train.iterations=12", "logging.trackers=[]", "logging.progress=false",
        "logging.eval_every=12", "reward.heldout={}", "train.checkpoint_every=100"])
    summary = train(cfg, tmp_path / "run")
    before, after = summary["eval_reward_before"], summary["eval_reward_after"]
    assert after > before + 0.03, (before, after)
    recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if "reward_mean" in r]
    assert len(train_recs) == 12 and all(r["skipped_steps"] == 0 for r in train_recs)
    assert summary["skipped_steps"] == 0
