"""Hub file references (``hf://ORG/NAME/FILE``, :mod:`flowrl.utils.hub`): how they parse, the cached copy
found offline, and the one-line error when the file is neither cached nor downloadable."""
import pytest

from flowrl.utils import hub
from helpers import fake_hub_cache


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Downloads off and an empty hub cache of this test's own (tmp_path/hub)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


@pytest.mark.parametrize("ref, want", [
    ("hf://xswu/HPSv2/HPS_v2.1_compressed.pt", ("xswu/HPSv2", "HPS_v2.1_compressed.pt", None, "model")),
    ("hf://org/name@v1.0/sub/dir/w.pth", ("org/name", "sub/dir/w.pth", "v1.0", "model")),
    ("hf://datasets/org/name/train.json", ("org/name", "train.json", None, "dataset")),
])
def test_hub_file_references_parse_and_print_back(ref, want):
    f = hub.parse_hub_file(ref)
    assert (f.repo_id, f.filename, f.revision, f.repo_type) == want and str(f) == ref
    assert f.download_command().startswith(f"hf download {want[0]} {want[1]}")


@pytest.mark.parametrize("ref", ["hf://HPS_v2.1.pt", "hf://org/name", "hf://org//w.pt", "hf://org/name@/w.pt",
                                 "checkpoints/w.pt"])
def test_malformed_references_say_the_form(ref):
    with pytest.raises(ValueError, match=r"hf://ORG/NAME/FILE") as e:
        hub.parse_hub_file(ref)
    assert "\n" not in str(e.value)


def test_a_cached_file_is_found_offline(offline, tmp_path):
    (tmp_path / "w.pt").write_bytes(b"weights")
    fake_hub_cache(offline, "org/name", {"sub/w.pt": tmp_path / "w.pt"})
    path = hub.hub_file("hf://org/name/sub/w.pt", "reward.options.x.checkpoint")
    assert path.read_bytes() == b"weights" and path.is_relative_to(offline)
    assert hub.cached_hub_file("hf://org/name/other.pt") is None


def test_a_file_neither_cached_nor_downloadable_fails_in_one_line(offline):
    with pytest.raises(FileNotFoundError) as e:
        hub.hub_file("hf://xswu/HPSv2/HPS_v2.1_compressed.pt", "reward.options.hps.checkpoint")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("reward.options.hps.checkpoint=hf://xswu/HPSv2/HPS_v2.1_compressed.pt")
    assert "HF_HUB_OFFLINE is set" in msg and "`hf download xswu/HPSv2 HPS_v2.1_compressed.pt`" in msg
