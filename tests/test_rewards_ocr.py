"""OCR reward: pure scoring rules, then real OCR engines (offline EasyOCR weights, tesseract) on
text rendered with PIL's bundled FreeType font."""
import math
import shutil
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from flowrl import rewards
from flowrl.rewards.ocr import levenshtein, quoted_text, text_similarity


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


# ---------------------------------------------------------------- scoring rules
def test_quoted_text():
    assert quoted_text('a neon sign that says "Open 24h" at night') == "Open 24h"
    assert quoted_text("a poster reading \u201cHello\u201d") == "Hello"
    assert quoted_text('"Big" and "Sale"') == "Big Sale"
    assert quoted_text("a cat on a sofa") is None
    assert quoted_text('empty quotes "  "') is None


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("same", "same") == 0


def test_reading_order_puts_a_slanted_line_back_together():
    from flowrl.rewards.ocr import reading_order

    def box(x, y, w=40, h=20):
        return [(x, y), (x + w, y), (x + w, y + h), (x, y + h)]
    # EasyOCR lists straight boxes first: here "Goal Achieved" (one box) before the slanted "Step"
    slanted_line = [box(60, 58), box(0, 66)]
    assert reading_order(slanted_line) == [1, 0]
    two_lines = [box(0, 100), box(50, 0), box(0, 2), box(60, 104)]  # line 1 at y ~ 0, line 2 at y ~ 100
    assert reading_order(two_lines) == [2, 1, 0, 3]
    assert reading_order([]) == []


def test_text_similarity_follows_flow_grpo_rules():
    assert text_similarity("Hello World", "hello world") == 1.0  # case and spaces ignored
    assert text_similarity("WELCOME: Hello World!!", "Hello World") == 1.0  # target inside the reading
    assert text_similarity("Helo World", "Hello World") == pytest.approx(0.9)  # one edit in 10 characters
    assert text_similarity("", "Hello") == 0.0
    assert text_similarity("completely unrelated long text", "Hi") == 0.0  # distance capped at len(target)


# ---------------------------------------------------------------- rendered images
FONT = ImageFont.load_default(size=36)  # Pillow's bundled FreeType font: no system font needed


def render(text, size=(256, 256), bg=(235, 230, 210), fg=(20, 20, 60), base=None):
    im = base.copy() if base is not None else Image.new("RGB", size, bg)
    d = ImageDraw.Draw(im)
    left, top, right, bottom = d.textbbox((0, 0), text, font=FONT)
    x, y = (im.width - (right - left)) / 2 - left, (im.height - (bottom - top)) / 2 - top
    if base is not None:
        d.rectangle((x + left - 8, y + top - 8, x + right + 8, y + bottom + 8), fill=(250, 250, 250))
    d.text((x, y), text, fill=fg, font=FONT)
    return im


def photo_with_sign(text):
    from sklearn.datasets import load_sample_images

    photo = Image.fromarray(load_sample_images().images[0]).resize((256, 256), Image.BICUBIC)
    return render(text, base=photo)


def batch(pils):
    return torch.stack([torch.from_numpy(np.array(p)).permute(2, 0, 1).float() / 255 for p in pils])


CASES = [  # (rendered text, prompt)
    ("Hello World", 'a sign that says "Hello World"'),
    ("FLOW RL 2025", 'a logo reading "FLOW RL 2025"'),
    ("Goodbye Moon", 'a card that says "Hello World"'),  # different text
    ("Helo Wrld", 'a card that says "Hello World"'),  # misspelled: partial credit
    ("", 'a blank card that says "Hello World"'),  # no text at all
]


def check_backend(reward, capsys, label):
    pils = [render(t) for t, _ in CASES] + [photo_with_sign("Open Late")]
    prompts = [p for _, p in CASES] + ['a street photo with a sign "Open Late"']
    images = batch(pils)
    t0 = time.perf_counter()
    s = reward(images, prompts)
    per_image = (time.perf_counter() - t0) / len(pils)
    with capsys.disabled():
        print(f"\n[{label}] OCR per-image time: {per_image * 1000:.0f} ms ({len(pils)} images 256x256, "
              f"{torch.get_num_threads()} threads); scores {[round(v, 3) for v in s.tolist()]}")
    assert s.shape == (len(pils),) and s.dtype == torch.float32
    exact, exact2, different, misspelled, blank, photo = s.tolist()
    assert exact >= 0.95 and exact2 >= 0.95 and photo >= 0.95
    assert different <= 0.5 and blank == 0.0  # clearly lower
    assert different < misspelled < exact  # graded
    # batching does not change readings
    torch.testing.assert_close(torch.cat([reward(images[i:i + 1], prompts[i:i + 1]) for i in (0, 2)]), s[[0, 2]])


def check_not_applicable(reward):
    calls = []
    read = reward.backend.read
    reward.backend.read = lambda imgs: calls.append(len(imgs)) or read(imgs)
    try:
        s = reward(batch([render("Hello"), render("Hello")]), ["a cat", 'a sign "Hello"'])
    finally:
        reward.backend.read = read
    assert math.isnan(s[0]) and s[1] >= 0.95
    assert calls == [1]  # the image whose prompt quotes nothing is not read


@pytest.fixture(scope="module")
def easyocr_reward():
    return rewards.build("ocr", backend="easyocr")


def test_easyocr_offline_weights_on_rendered_text(easyocr_reward, capsys):
    check_backend(easyocr_reward, capsys, "easyocr")


def test_easyocr_skips_prompts_without_quotes(easyocr_reward):
    check_not_applicable(easyocr_reward)


def test_rapidocr_reads_rendered_text_offline(capsys, monkeypatch):
    """RapidOCR with the PP-OCR models bundled in its wheel: every socket is refused while it loads and
    reads, so nothing can be downloaded."""
    import socket

    def no_network(*a, **k):
        raise OSError("network disabled by the test")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    reward = rewards.build("ocr", backend="rapidocr")
    check_backend(reward, capsys, "rapidocr")
    check_not_applicable(reward)


@pytest.mark.skipif(shutil.which("tesseract") is None,
                    reason="tesseract binary not installed (apt-get install tesseract-ocr): optional backend")
def test_tesseract_on_rendered_text(capsys):
    reward = rewards.build("ocr", backend="tesseract")
    check_backend(reward, capsys, "tesseract")
    check_not_applicable(reward)


def test_backend_errors_say_how_to_fix(tmp_path, monkeypatch):
    import pytesseract

    # tesseract_cmd is module-global in pytesseract: restore it after this test
    monkeypatch.setattr(pytesseract.pytesseract, "tesseract_cmd", pytesseract.pytesseract.tesseract_cmd)
    with pytest.raises(ValueError, match="backend must be one of 'rapidocr', 'easyocr', 'tesseract'"):
        rewards.build("ocr", backend="paddle")
    with pytest.raises(FileNotFoundError, match="craft_mlt_25k.pth"):
        rewards.build("ocr", backend="easyocr", model_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="apt-get install tesseract-ocr"):
        rewards.build("ocr", backend="tesseract", tesseract_cmd=str(tmp_path / "no-tesseract"))
