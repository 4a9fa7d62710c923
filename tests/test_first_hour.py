"""The first hour, second pass (issue 35): what a newcomer meets that is not a bad-input row.

Torch's thread count chosen for CPU work and said once; two commands that both need the digits base
pretrain it once (a lock: the second waits and says so); sample grids people can read (a caption per
row, an edit's source images, videos separated, no empty canvas).
"""
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.utils.threads import SMALL_MODEL_PARAMS, choose_threads


# ---------------------------------------------------------------- threads
def test_thread_choice():
    assert choose_threads(8, 0.2, 50_000_000, "3") == (3, "OMP_NUM_THREADS=3")  # the user's setting wins
    n, why = choose_threads(2, 8.1, 580_000, None)
    assert n == 1 and "0.58M-parameter model" in why and "load average 8.1" in why
    assert choose_threads(2, 0.1, 500_000_000, None)[0] == 2  # idle cores, a large model: all of them
    assert choose_threads(8, 5.0, 500_000_000, None)[0] == 3  # the cores others leave free
    assert choose_threads(4, 9.0, 500_000_000, None)[0] == 1 and choose_threads(4, None, None, None)[0] == 4
    assert choose_threads(8, 0.0, 500_000_000, None, procs=2)[0] == 4  # two processes of one run share the cores
    assert SMALL_MODEL_PARAMS > 580_000


def test_threads_are_chosen_once_under_the_command_line_only(monkeypatch, capsys):
    from flowrl.utils import threads

    for var in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    before = torch.get_num_threads()
    assert threads.use_cpu_threads(1000) is None  # a library caller keeps its setting
    with threads.chosen_threads():
        assert threads.use_cpu_threads(1000, "cuda") is None  # GPU work: not torch's CPU threads
        assert threads.use_cpu_threads(1000) == 1 and torch.get_num_threads() == 1
        assert threads.use_cpu_threads(10**9) is None  # once per command
    assert torch.get_num_threads() == before
    err = capsys.readouterr().err
    assert err.count("[flowrl] CPU work on 1 torch thread(s)") == 1 and "set OMP_NUM_THREADS to choose" in err


# ---------------------------------------------------------------- one pretraining of the digits base at a time
def test_a_second_command_waits_for_the_digits_base(tmp_path, monkeypatch, capsys):
    """While one process pretrains the cached base (holds its lock), a second that needs it waits, says so,
    and then loads the base the first one wrote instead of pretraining its own."""
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines import digits

    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path))
    path = digits.default_base_path()
    pretrained = []
    monkeypatch.setattr(digits, "pretrain_digits", lambda *a, **k: pretrained.append(a))
    loaded = {}
    with digits.base_lock(path):
        waiter = threading.Thread(target=lambda: loaded.setdefault("policy", digits.load_digits_policy()))
        waiter.start()
        deadline = time.monotonic() + 120
        while "waiting for it to finish" not in capsys.readouterr().err:  # (what the second command prints)
            assert time.monotonic() < deadline and waiter.is_alive()
            time.sleep(0.05)
        torch.manual_seed(0)  # the first process writes the base while the second waits
        digits.DigitsPolicy(SD3Transformer2DModel(**{**digits.tiny_transformer_config(), "num_layers": 1}),
                            digits.DigitTextEncoder()).save_pretrained(path)
    waiter.join(120)
    assert isinstance(loaded.get("policy"), digits.DigitsPolicy) and pretrained == []


# ---------------------------------------------------------------- grids people read
def _png(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def test_video_grid_fills_its_canvas_and_separates_videos(tmp_path):
    """4 videos in a grid asked for 8 per row: 4 columns (no grey half), frames 1 px apart, videos
    VIDEO_PAD px apart on the dark ground; the GIF the same size per frame, captioned like the PNG."""
    from flowrl.media import VIDEO_BACKGROUND, VIDEO_PAD, save_samples

    v = torch.ones(4, 3, 5, 8, 6) * torch.linspace(0.9, 0.5, 5).view(1, 1, 5, 1, 1)  # flat frames, 0.9 ... 0.5
    written = save_samples(v, tmp_path / "s.png", nrow=8)
    grid = _png(written[0])
    strip_w = 5 * 6 + 4  # 5 frames, 4 one-pixel gaps
    assert grid.shape[:2] == (8 + 2 * VIDEO_PAD, 4 * (strip_w + VIDEO_PAD) + VIDEO_PAD)
    dark, row = round(VIDEO_BACKGROUND * 255), grid[VIDEO_PAD + 3]  # a line through the videos
    strip = row[VIDEO_PAD:VIDEO_PAD + strip_w, 0]
    assert (grid[:, :VIDEO_PAD] == dark).all() and (row[VIDEO_PAD + strip_w:2 * VIDEO_PAD + strip_w] == dark).all()
    assert [int(strip[6 + 7 * f]) for f in range(4)] == [255] * 4  # a white line between frames
    assert np.allclose([int(strip[7 * f]) for f in range(5)], (torch.linspace(0.9, 0.5, 5) * 255).tolist(), atol=1)
    with Image.open(written[1]) as gif:
        assert gif.n_frames == 5 and gif.size == (4 * (6 + VIDEO_PAD) + VIDEO_PAD, 8 + 2 * VIDEO_PAD)
    captioned = _png(save_samples(v[:2], tmp_path / "c.png", nrow=1, labels=["a sign", "a shop"])[0])
    assert captioned.shape[0] == 2 * (14 + 8 + 2 * VIDEO_PAD)


def test_edit_grid_shows_sources_and_instructions(tmp_path):
    """An editing set's grid: each row's instruction above it, its source image(s) before it (one, or a
    list per row), a header naming both parts; the captions are drawn (dark pixels on white)."""
    from flowrl.data import load_prompts
    from flowrl.data.items import item_sources, item_texts
    from flowrl.media import save_samples
    from flowrl.utils.images import CAPTION_PX

    items = load_prompts("digits-edit-sample")[:2]
    results = torch.zeros(4, 3, 16, 16)  # black results
    plain = _png(save_samples(results, tmp_path / "plain.png", nrow=2)[0])
    one = _png(save_samples(results, tmp_path / "one.png", nrow=2, labels=item_texts(items),
                            sources=item_sources(items))[0])
    two = _png(save_samples(results, tmp_path / "two.png", nrow=2, labels=item_texts(items),
                            sources=[[s, s] for s in item_sources(items)])[0])
    assert plain.shape == (2 * 17 + 1, 2 * 17 + 1, 3)
    assert one.shape == (CAPTION_PX + 2 * (CAPTION_PX + 18), 18 + 3 + 2 * 17 + 1, 3)  # header, 2 x (caption, row)
    assert two.shape[1] == one.shape[1] + 17
    caption = one[CAPTION_PX:2 * CAPTION_PX]
    assert (caption == 255).mean() > 0.5 and (caption < 100).any()  # text on white
    src = torch.nn.functional.interpolate(items[0].image[None].float(), size=(16, 16), mode="bilinear")[0]
    shown = one[2 * CAPTION_PX + 1:2 * CAPTION_PX + 17, 1:17].astype(float) / 255  # [16, 16, 3]
    assert np.abs(shown - src.permute(1, 2, 0).clamp(0, 1).numpy()).max() < 0.01  # the source, beside the results
