import pytest
import torch

from flowrl.pipelines import build_policy
from flowrl.pipelines.digits import DigitsPolicy, tokenize
from flowrl.data.digits import parse_digit


def test_parse_and_tokenize():
    assert parse_digit("a handwritten digit 7") == 7 and parse_digit("Digit SEVEN please") == 7
    assert parse_digit("a cat") is None
    ids = tokenize(["a handwritten digit 7", ""], max_len=8)
    assert ids.shape == (2, 8) and ids[0, 3] == 8 and ids[1].sum() == 0


def test_save_load_round_trip(tiny_digits_policy, tmp_path):
    tiny_digits_policy.save_pretrained(tmp_path / "m")
    loaded = build_policy("digits", str(tmp_path / "m"))
    x = tiny_digits_policy.initial_noise([1, 2])
    c = tiny_digits_policy.encode_prompts(["a handwritten digit 1", "a handwritten digit 2"])
    with torch.no_grad():
        assert torch.equal(tiny_digits_policy.velocity(x, torch.tensor([0.5, 0.5]), c),
                           loaded.velocity(x, torch.tensor([0.5, 0.5]), loaded.encode_prompts(
                               ["a handwritten digit 1", "a handwritten digit 2"])))


def test_guidance_changes_velocity_and_decode_range(tiny_digits_policy, tmp_path):
    tiny_digits_policy.save_pretrained(tmp_path / "m")
    g3 = DigitsPolicy.from_pretrained(tmp_path / "m", guidance_scale=3.0)
    x = g3.initial_noise([0])
    s = torch.tensor([0.7])
    with torch.no_grad():
        v1 = tiny_digits_policy.velocity(x, s, tiny_digits_policy.encode_prompts(["a handwritten digit 3"]))
        v3 = g3.velocity(x, s, g3.encode_prompts(["a handwritten digit 3"]))
    assert not torch.allclose(v1, v3)
    img = g3.decode(torch.randn(2, 1, 16, 16) * 3)
    assert img.shape == (2, 3, 16, 16) and img.min() >= 0 and img.max() <= 1


def test_initial_noise_depends_only_on_seed(tiny_digits_policy):
    a = tiny_digits_policy.initial_noise([5, 6])
    b = tiny_digits_policy.initial_noise([6])
    assert torch.equal(a[1], b[0]) and not torch.equal(a[0], a[1])


def test_missing_model_path_says_how_to_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="flowrl pretrain-digits"):
        build_policy("digits", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="make-tiny"):
        build_policy("sd3", str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="unknown pipeline 'sdxl'.* Valid pipelines: digits"):
        build_policy("sdxl", None)


def test_bad_guidance():
    from flowrl.pipelines.digits import DigitTextEncoder

    with pytest.raises(ValueError, match="guidance_scale must be a number >= 1"):
        DigitsPolicy(torch.nn.Linear(1, 1), DigitTextEncoder(), guidance_scale=0.5)
