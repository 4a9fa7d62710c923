"""Table-driven bad inputs: each gets a clear error naming the problem and the fix (or a documented
recovery), and leaves no corrupted file behind."""
import errno
import socket

import pytest
import torch

from conftest import tiny_train_overrides
from flowrl.data import load_prompts
from flowrl.checkpoints.unsharded import UnshardedCheckpoint
from flowrl.checkpoints.common import CheckpointError, list_checkpoints
from flowrl.checkpoints import load_checkpoint
from flowrl.trainers.config import load_config
from flowrl.errors import ConfigError

RECIPE = "recipes/digits.yaml"


def cfg(*overrides):
    return lambda tmp: load_config(RECIPE, list(overrides))


def prompts_file(content: bytes, name="p.txt"):
    def f(tmp):
        p = tmp / name
        p.write_bytes(content)
        return load_prompts(str(p))
    return f


def vlm(url_kind):
    def f(tmp):
        from flowrl.rewards.vlm import VLMJudge

        if url_kind == "down":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]  # closed again: nothing listens there
            j = VLMJudge(url=f"http://127.0.0.1:{port}/v1", retries=0, timeout=2)
        else:
            j = VLMJudge(url="ftp://nowhere")
        return j(torch.rand(1, 3, 8, 8), ["a cat"])
    return f


def corrupt_checkpoint(tmp):
    ck = UnshardedCheckpoint.save(tmp / "ck", 1, trainable={"w": torch.ones(2)}, optimizer={}, scheduler={}, state={})
    (ck / "trainable.safetensors").write_bytes(b"\x00" * 10)
    return load_checkpoint(ck)


def disk_full_checkpoint(tmp):
    import flowrl.checkpoints.unsharded as C

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    try:
        with pytest.MonkeyPatch.context() as mp:  # torch.save is global: always restored
            mp.setattr(C.torch, "save", full)
            UnshardedCheckpoint.save(tmp / "ck", 2, trainable={"w": torch.ones(2)}, optimizer={}, scheduler={}, state={})
    finally:
        assert list_checkpoints(tmp / "ck") == [] and not any((tmp / "ck").iterdir())  # nothing half-written


def wrong_shape_reward(tmp):
    from flowrl.scoring import score_images

    return score_images(lambda im, p: torch.zeros(3, 2), torch.rand(3, 3, 4, 4), ["a"] * 3)


def eval_suite(text: str = None, name: str = "genevel"):
    def f(tmp):
        from flowrl.eval.suites import load_suite

        if text is None:
            return load_suite(name)
        (tmp / "s.jsonl").write_text(text)
        return load_suite(str(tmp / "s.jsonl"))
    return f


def suite_file(text: str, name: str):
    def f(tmp):
        from flowrl.eval.suites import load_suite

        (tmp / name).write_text(text)
        return load_suite(str(tmp / name))
    return f


def geneval_detector_wrong_shape(tmp):
    from flowrl.rewards import build

    reward = build("geneval", detector="builtins:len")  # returns an int, not one dict per image
    return reward(torch.rand(2, 3, 8, 8), ["a photo of a dog"] * 2)


def eval_models_on_two_pipelines(tmp):
    from flowrl.eval.models import ModelSpec, check_same_pipeline

    specs = [ModelSpec("run", "runs/a", "a"), ModelSpec("config", "recipes/sd3_group_pickscore.yaml", "sd3")]
    return check_same_pipeline(specs, [load_config(RECIPE), load_config("recipes/sd3_group_pickscore.yaml")])


def recipe_file(text: str):
    def f(tmp):
        p = tmp / "r.yaml"
        p.write_text(text)
        return load_config(str(p))
    return f


def remote_reward_down(tmp):
    from flowrl.rewards import build

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    return build("remote", url=f"http://127.0.0.1:{port}", retries=3, backoff=5.0)  # refused: no retry, no wait


def hub_model(endpoint=None, offline=True):
    """A hub id absent from an empty cache; downloads off (HF_HUB_OFFLINE) or the hub at ``endpoint``."""
    def f(tmp):
        from huggingface_hub import constants

        from flowrl.utils import hub

        hub._unreachable.cache_clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
            mp.setattr(constants, "HF_HUB_OFFLINE", offline)
            if endpoint:
                mp.setenv("HF_ENDPOINT", endpoint(tmp))
            return hub.require_hub_model("flowrl-test/absent", "the sd3 base model", "model.path", str(tmp / "hub"))
    return f


def closed_endpoint(tmp):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


CASES = [
    # (id, callable(tmp_path), exception, message pattern)
    ("unknown key", cfg("train.lrr=1"), ConfigError, r"unknown key train\.lrr.*Did you mean train\.lr"),
    ("unknown section", cfg("trian.lr=1"), ConfigError, r"unknown section 'trian'.*Did you mean 'train'"),
    ("wrong type", cfg("train.lr=fast"), ConfigError, r"train\.lr must be a number"),
    ("wrong type int", cfg("train.iterations=1.5"), ConfigError, r"train\.iterations must be an integer"),
    ("negative size", cfg("train.batch_size=-8"), ConfigError, r"train\.batch_size must be a positive integer"),
    ("zero size", cfg("train.iterations=0"), ConfigError, r"train\.iterations must be a positive integer"),
    ("zero minibatch", cfg("train.minibatch_size=0"), ConfigError, r"train\.minibatch_size must be a positive"),
    ("group does not divide batch", cfg("train.batch_size=36"), ConfigError, r"not a multiple.*use e\.g\. 32"),
    ("group size 1", cfg("sampler.group_size=1"), ConfigError, r"group_size must be an integer >= 2"),
    ("unknown sampler", cfg("sampler.name=grpo"), ConfigError, r"unknown sampler 'grpo'.*Valid samplers"),
    ("unknown sampler option", cfg("sampler.window=3"), ConfigError, r"sampler\.window.*Valid:"),
    ("unknown reward", cfg("reward.weights={pickscore2: 1}"), ConfigError, r"unknown reward 'pickscore2'.*pickscore"),
    ("non-numeric reward weight", cfg("reward.weights={digits: high}"), ConfigError, r"must be a number"),
    ("unknown labelled reward", cfg("reward.heldout={genevel@official: {}}"), ConfigError,
     r"reward\.heldout: unknown reward 'genevel'.*geneval"),
    ("empty reward label", cfg("reward.heldout={geneval@: {}}"), ConfigError, r"label after '@' is empty"),
    ("labelled reward's options", cfg("reward.heldout={geneval@official: {scor: official}}"), ConfigError,
     r"reward\.heldout\.geneval@official\.scor: not an option.*Did you mean .*official\.score"),
    ("unknown pipeline", cfg("model.pipeline=sdxl"), ConfigError, r"unknown pipeline 'sdxl'"),
    ("unknown step type", cfg("sampler.step=ddim"), ConfigError, r"unknown step type 'ddim'.*Valid step types"),
    ("guidance below 1", cfg("model.guidance_scale=0"), ConfigError, r"guidance_scale must be >= 1\.0"),
    ("bad mixed precision", cfg("train.mixed_precision=fp4"), ConfigError, r"'no', 'bf16' or 'fp16'"),
    ("bad override syntax", cfg("train.lr"), ConfigError, r"section\.key=value"),
    ("undotted override", cfg("lr=1"), ConfigError, r"must be dotted"),
    ("missing recipe", lambda tmp: load_config(tmp / "nope.yaml"), ConfigError, r"not found\. Shipped recipes"),
    ("recipe a YAML list", recipe_file("- model\n- train\n"), ConfigError, r"holds a YAML list, not a mapping"),
    ("recipe a plain string", recipe_file("digits\n"), ConfigError, r"holds a plain string.*--config digits"),
    ("empty recipe", recipe_file("# nothing yet\n"), ConfigError, r"is empty.*start from a shipped recipe"),
    ("base model not cached, offline", hub_model(), FileNotFoundError,
     r"'flowrl-test/absent' \(model\.path\) is neither a local directory nor in the local Hugging Face cache.*"
     r"HF_HUB_OFFLINE is set: download it on a machine with network.*point model\.path to a local copy.*HF_HOME"),
    ("base model not cached, hub unreachable", hub_model(closed_endpoint, offline=False), FileNotFoundError,
     r"http://127\.0\.0\.1:\d+ cannot be reached from here"),
    ("reward server not running", remote_reward_down, RuntimeError, r"/health: connection refused.*serve-reward"),
    ("missing model path", lambda tmp: __import__("flowrl.pipelines", fromlist=["x"]).build_policy(
        "digits", str(tmp / "missing")), FileNotFoundError, r"flowrl pretrain-digits"),
    ("missing sd3 path", lambda tmp: __import__("flowrl.pipelines", fromlist=["x"]).build_policy(
        "sd3", str(tmp / "missing")), FileNotFoundError, r"make-tiny"),
    ("empty prompt file", prompts_file(b"\n\n"), ValueError, r"is empty; add at least one prompt"),
    ("non-UTF-8 prompts", prompts_file("caf\xe9".encode("latin-1")), ValueError, r"not UTF-8.*re-save it as UTF-8"),
    ("JSONL without prompt", prompts_file(b'{"title": "x"}\n', "p.jsonl"), ValueError, r"needs a 'prompt' field"),
    ("missing prompt file", lambda tmp: load_prompts(str(tmp / "none.txt")), FileNotFoundError, r"not found"),
    ("prompt not a string", lambda tmp: load_prompts(["ok", 3]), ValueError, r"expected a string"),
    ("corrupt checkpoint", corrupt_checkpoint, CheckpointError, r"unreadable.*Delete it"),
    ("disk full writing checkpoint", disk_full_checkpoint, CheckpointError, r"No space left.*previous checkpoints"),
    ("reward wrong shape", wrong_shape_reward, ValueError, r"returned shape \(3, 2\).*one float per image"),
    ("reward service down", vlm("down"), RuntimeError, r"failed after 1 attempts"),
    ("reward service bad url", vlm("url"), ValueError, r"url must be an http"),
    ("eval: unknown suite", eval_suite(), ConfigError, r"unknown suite 'genevel'; valid suites: .*geneval.*ocr"),
    # a file read by its suffix: YAML lines or a CSV header never become prompts
    ("YAML prompt file", prompts_file(b"prompts:\n  - a cat\n", "p.yaml"), ValueError,
     r"p\.yaml: a \.yaml file is not a prompt set; give a \.txt \(one prompt per line\), a \.jsonl .*dataset directory"),
    ("CSV prompt file", prompts_file(b"prompt,tag\na cat,animals\n", "p.csv"), ValueError,
     r"p\.csv: a \.csv file is not a prompt set"),
    ("eval: YAML suite file", suite_file("- a cat\n- a dog\n", "s.yaml"), ValueError,
     r"s\.yaml: a \.yaml file is not a suite; give a \.txt \(one prompt per line\), \.jsonl .* or \.csv"),
    ("eval: JSON suite file", suite_file('["a cat", "a dog"]\n', "s.json"), ValueError, r"a \.json file is not a suite"),
    ("eval: TSV suite file", suite_file("prompt\ttag\na cat\tanimals\n", "s.tsv"), ValueError,
     r"a \.tsv file is not a suite"),
    ("eval: metadata row without clauses", eval_suite('{"prompt": "two clocks", "tag": "counting"}\n'), ConfigError,
     r"s\.jsonl:1: tag 'counting' without its 'include' clauses"),
    ("geneval: detector of the wrong shape", geneval_detector_wrong_shape, ConfigError,
     r"detector 'builtins:len' returned int for 2 images; it must return one dict per image"),
    ("eval: run and config on two pipelines", eval_models_on_two_pipelines, ConfigError,
     r"different pipelines \(a \(run\): digits, sd3 \(config\): sd3\)"),
]


@pytest.mark.parametrize("name,fn,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, fn, exc, match, tmp_path):
    with pytest.raises(exc, match=match):
        fn(tmp_path)


def test_hub_models_that_can_load_pass(tmp_path, monkeypatch):
    """A cached hub id, or one the hub answers for (any HTTP status), passes the check; so do local paths."""
    import http.server
    import threading

    from huggingface_hub import constants

    from flowrl.utils import hub

    (tmp_path / "hub" / "models--flowrl-test--cached" / "snapshots" / "abc").mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.require_hub_model("flowrl-test/cached", "m", "model.path", str(tmp_path / "hub"))
    hub.require_hub_model(str(tmp_path), "m", "model.path")  # a local directory
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        hub._unreachable.cache_clear()
        hub.require_hub_model("flowrl-test/downloadable", "m", "model.path", str(tmp_path / "hub"))
    finally:
        server.shutdown()
        hub._unreachable.cache_clear()


def test_matrix_is_large_enough():
    assert len(CASES) >= 25


def test_checkpoint_from_another_config(tiny_digits_dir, tmp_path):
    from flowrl.trainers.online import OnlineTrainer, train

    run = tmp_path / "run"
    train(load_config(RECIPE, tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 1})), run)
    other = load_config(RECIPE, tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 2,
                                                                          "sampler.noise_level": 0.5}))
    with pytest.raises(ConfigError, match=r"sampler\.noise_level: 0\.7 -> 0\.5.*new --output-dir"):
        OnlineTrainer(other, run, resume=True)
