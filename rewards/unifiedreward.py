"""``unifiedreward``: UnifiedReward (Wang et al. 2025, arXiv 2503.05236), a Qwen-VL judge, pointwise or pairwise.

``mode="pointwise"`` (text-to-image): each image with UnifiedReward's point-score prompt
(:data:`POINT_TEMPLATE`, from the authors' ``inference_qwen/image_generation/qwen_point_score_image_generation.py``,
the caption in ``{prompt}``) through the checkpoint's chat template. The reply's first ``Final Score: s`` with
``s`` in [1, 5] (Flow-GRPO's ``unifiedreward_score_sglang`` pattern ``Final Score:\\s*([1-5](?:\\.\\d+)?)``) gives
**reward = s / 5**; a reply without one scores 0, as Flow-GRPO's does (``on_invalid="nan"``: NaN; ``"raise"``).
``resize=512`` first resizes every image to 512 x 512, as Flow-GRPO sends them. Rows with a source are NaN
(pointwise edit judging, UnifiedReward-Edit's two JSON prompts, is not built).

``mode="dimensions"`` (UnifiedReward-2.0, text-to-image): its pointwise prompt (:data:`DIMENSIONS_TEMPLATE`,
``inference_qwen/UnifiedReward-2.0-inference/point_score_ACS_image_generation.py``) asks for ``Alignment``,
``Coherence`` and ``Style Score (1-5): s``; read as Pref-GRPO's ``extract_normalized_rewards`` reads them (a
dimension missing from a reply takes the mean of that dimension over the call's other replies), **reward =
sum_k w_k s_k / (5 sum_k w_k)** with ``dimensions`` the weights ``w_k`` (default 1 each). Pref-GRPO trains on each
dimension as a reward of its own (raw 1-5, weighted): ``dimensions: {Alignment: 1.0}`` is its alignment reward / 5.

``mode="pairwise"``: a per-sample reward from preferences, as Pref-GRPO (arXiv 2508.20751,
github CodeGoat24/Pref-GRPO) makes one: within a group (the rows of one call with the same prompt and, for an
edit, the same source), every pair ``i < j`` is judged once with ``i`` as Image 1; the winner gets 1, a tie or an
answer naming neither 0.5 each; **reward = wins / comparisons** (the win rate against the rest of the group,
rounded to 3 decimals as Pref-GRPO does), in [0, 1]. Text-to-image pairs use UnifiedReward's pair-rank prompt
(:data:`PAIR_TEMPLATE`, ``qwen_pair_rank_image_generation.py``: "Image 1 is better." / "Image 2 is better." /
"Both images are equally good."); edits show the source, then both results, with UnifiedReward-Edit's pairwise
prompt as Pref-GRPO sends it (:data:`EDIT_PAIR_TEMPLATE`; "Edited image 1 is better"). The verdict is the text
inside ``<answer>...</answer>`` when there is one (the Think models), else the whole reply, searched for the
labels case-insensitively (Pref-GRPO's ``unifiedreward_edit_pairwise``). A group of one row has nothing to be
compared with: NaN. So a group must reach the reward whole: leave ``sampler.max_batch`` unset or a multiple of
``samples_per_prompt`` (a group split over two calls is ranked in each part separately). ``G (G - 1) / 2``
judge calls per group of ``G``.

Images go through qwen-vl-utils' preparation and the model through transformers (:mod:`flowrl.rewards._qwen_vl`);
generation is the checkpoint's generation config with ``max_new_tokens`` (512), what the authors' scripts pass.
Checkpoints: ``CodeGoat24/UnifiedReward-qwen-7b`` (the default; also ``-3b``, ``-32b``, ``-72b``),
``CodeGoat24/UnifiedReward-2.0-qwen-7b`` (pairwise), ``CodeGoat24/UnifiedReward-Edit-qwen-7b`` (edit pairs),
``CodeGoat24/UnifiedReward-Think-qwen-7b`` (``<answer>`` verdicts, with its own ``pair_template``). Served in its
own process: ``flowrl serve-reward unifiedreward --options ...`` and the ``remote`` reward.
"""
from __future__ import annotations

import itertools
import logging
import re
from typing import Literal, Mapping, Optional

import torch

from flowrl.data.items import sources_per_row
from flowrl.options import Device, ModelSource, NonNegativeInt, PositiveInt

from ._clip_common import DTypeLike, check_inputs
from ._qwen_vl import ChatVLM

log = logging.getLogger(__name__)

POINT_TEMPLATE = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in the "
    "caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nExtract key elements from the provided text "
    "caption, evaluate their presence in the generated image using the format: 'element (type): value' (where "
    "value=0 means not generated, and value=1 means generated), and assign a score from 1 to 5 after 'Final "
    "Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]")
PAIR_TEMPLATE = (
    "You are given a text caption and two generated images based on that caption. Your task is to evaluate and "
    "compare these images based on two key criteria:\n1. Alignment with the Caption: Assess how well each image "
    "aligns with the provided caption. Consider the accuracy of depicted objects, their relationships, and "
    "attributes as described in the caption.\n2. Overall Image Quality: Examine the visual quality of each image, "
    "including clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nCompare both images "
    "using the above criteria and select the one that better aligns with the caption while exhibiting superior "
    "visual quality.\nProvide a clear conclusion such as \"Image 1 is better.\", \"Image 2 is better.\" and \"Both "
    "images are equally good.\"\nYour task is provided as follows:\nText Caption: [{prompt}]")
EDIT_PAIR_TEMPLATE = (
    "You are tasked with comparing two edited images and determining which one is better based on the given "
    "criteria.\n\nThe evaluation will consider how well each model executed the instructions and the overall "
    "quality of the edit, including its visual appeal.\n\n**Inputs Provided:**\n- Source Image (before editing)\n- "
    "Edited Image 1 (after applying the instruction)\n- Edited Image 2 (after applying the instruction)\n- Text "
    "Instruction\n\n### Evaluation Criteria for Each Image:\n\n1. **Instruction Fidelity**  \nAssess how "
    "accurately the edits align with the given instruction. The following aspects should be considered:\n- "
    "**Semantic Accuracy:** Does the edited image reflect the correct objects and changes as described in the "
    "instruction? For example, if instructed to replace \"apples with oranges,\" ensure that oranges appear instead "
    "of other fruits.\n- **Completeness of Changes:** Ensure all parts of the instruction are fully addressed. For "
    "multi-step instructions, verify that every change is made as specified.\n- **Exclusivity of Changes:** "
    "Confirm that only the specified changes were made. Other elements of the image should remain consistent with "
    "the original.\n\n2. **Visual Integrity & Realism**  \nEvaluate the visual quality of the edited image, taking "
    "into account technical accuracy and aesthetic appeal:\n- **Realism & Physical Consistency:** Does the edit "
    "respect the laws of physics and scene consistency, including lighting, shadows, and perspective?\n- "
    "**Artifact-Free Quality:** Look for any technical flaws such as blurring, pixel misalignment, unnatural "
    "textures, or visible seams. The image should be clean and free from distractions.\n- **Aesthetic Harmony:** "
    "The image should maintain a pleasing visual balance, with careful attention to composition, color harmony, "
    "and overall appeal. The changes should enhance the image rather than detract from it.\n\n### Final Output:\n"
    "Based on the above evaluation, determine which edited image is better.\n\nText instruction - {prompt}\n")
DIMENSIONS_TEMPLATE = (
    "You are presented with a generated image and its associated text caption. Your task is to analyze the image "
    "across multiple dimensions in relation to the caption. Specifically:\nProvide overall assessments for the image "
    "along the following axes (each rated from 1 to 5):\n- Alignment Score: How well the image matches the caption "
    "in terms of content.\n- Coherence Score: How logically consistent the image is (absence of visual glitches, "
    "object distortions, etc.).\n- Style Score: How aesthetically appealing the image looks, regardless of caption "
    "accuracy.\n\nOutput your evaluation using the format below:\n\nAlignment Score (1-5): X\nCoherence Score (1-5): "
    "Y\nStyle Score (1-5): Z\n\nYour task is provided as follows:\nText Caption: [{prompt}]")
DIMENSION_SCORE = re.compile(r"(\w+) Score \(1-5\):\s*([0-5](?:\.\d+)?)")
DEFAULT_DIMENSIONS = {"Alignment": 1.0, "Coherence": 1.0, "Style": 1.0}
FINAL_SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def point_score(text: str) -> Optional[float]:
    """The first ``Final Score: s`` (s in [1, 5]) of a reply, / 5; None when there is none."""
    m = FINAL_SCORE.search(text)
    return float(m.group(1)) / 5.0 if m else None


def dimension_scores(texts: list[str], names) -> list[dict[str, float]]:
    """Each reply's ``{dimension: s}`` for ``names``, as Pref-GRPO's ``extract_normalized_rewards`` reads
    UnifiedReward-2.0's ``NAME Score (1-5): s``: a dimension a reply lacks takes the mean of the replies that
    have it (0 when none has)."""
    found = [{k: float(v) for k, v in DIMENSION_SCORE.findall(t or "")} for t in texts]
    means = {}
    for k in names:
        have = [f[k] for f in found if k in f]
        means[k] = sum(have) / len(have) if have else 0.0
    return [{k: f.get(k, means[k]) for k in names} for f in found]


def verdict(text: str, labels: tuple[str, str]) -> tuple[float, float]:
    """``(win of Image 1, win of Image 2)`` from one pairwise reply: ``(1, 0)``, ``(0, 1)`` or a tie ``(0.5, 0.5)``
    (module doc); ``labels``: what names each image the better one."""
    m = ANSWER.search(text or "")
    answer = (m.group(1) if m else (text or "")).strip().lower()
    if not answer:
        return 0.5, 0.5
    for where in (answer, (text or "").lower()):
        if labels[0].lower() in where:
            return 1.0, 0.0
        if labels[1].lower() in where:
            return 0.0, 1.0
    return 0.5, 0.5


def win_rates(n: int, pairs: list[tuple[int, int]], verdicts: list[tuple[float, float]]) -> list[float]:
    """Each of ``n`` rows' wins / comparisons over the judged ``pairs`` (rounded to 3 decimals); NaN where a
    row was never compared."""
    wins, seen = [0.0] * n, [0] * n
    for (i, j), (a, b) in zip(pairs, verdicts):
        wins[i], wins[j], seen[i], seen[j] = wins[i] + a, wins[j] + b, seen[i] + 1, seen[j] + 1
    return [round(w / s, 3) if s else float("nan") for w, s in zip(wins, seen)]


def groups_of(prompts: list[str], rows: list[tuple]) -> list[list[int]]:
    """Row indices grouped by (prompt, source pixels), in first-seen order."""
    found: dict = {}
    for i, (p, src) in enumerate(zip(prompts, rows)):
        key = (p, tuple((tuple(s.shape), hash(s.detach().float().cpu().numpy().tobytes())) for s in src))
        found.setdefault(key, []).append(i)
    return list(found.values())


class UnifiedReward:
    """UnifiedReward's pointwise score / 5, or its pairwise win rate in each group; float32 [B] (module doc)."""

    name = "unifiedreward"
    resident_params = 8_292_166_656  # CodeGoat24/UnifiedReward-qwen-7b (Qwen2.5-VL-7B), for `flowrl plan`
    resident_note = "CodeGoat24/UnifiedReward-qwen-7b = Qwen2.5-VL-7B (8.29B)"

    def __init__(self, model: ModelSource = "CodeGoat24/UnifiedReward-qwen-7b", processor: Optional[ModelSource] = None,
                 mode: Literal["pointwise", "dimensions", "pairwise"] = "pointwise",
                 point_template: Optional[str] = None, pair_template: str = PAIR_TEMPLATE,
                 edit_pair_template: str = EDIT_PAIR_TEMPLATE,
                 dimensions: Mapping[str, float] = DEFAULT_DIMENSIONS, resize: Optional[PositiveInt] = None,
                 device: Device = "cpu", dtype: DTypeLike = "bfloat16", max_new_tokens: PositiveInt = 512,
                 seed: NonNegativeInt = 0, batch_size: PositiveInt = 8,
                 on_invalid: Literal["zero", "nan", "raise"] = "zero"):
        point_template = point_template or (DIMENSIONS_TEMPLATE if mode == "dimensions" else POINT_TEMPLATE)
        for key, text in (("point_template", point_template), ("pair_template", pair_template),
                          ("edit_pair_template", edit_pair_template)):
            if "{prompt}" not in text:
                raise ValueError(f"unifiedreward: {key} must contain '{{prompt}}', where the caption or instruction "
                                 f"goes")
        weights = {str(k): float(w) for k, w in dict(dimensions).items()}
        if not weights or any(w < 0 for w in weights.values()) or not sum(weights.values()) > 0:
            raise ValueError(f"unifiedreward: dimensions must map dimension names (Alignment, Coherence, Style) to "
                             f"weights >= 0 with a positive sum, got {dict(dimensions)!r}")
        self.mode, self.resize, self.seed, self.on_invalid = mode, resize, int(seed), on_invalid
        self.dimensions = weights
        self.templates = {"point": point_template, "pair": pair_template, "edit_pair": edit_pair_template}
        self.generation = {"max_new_tokens": int(max_new_tokens)}
        self.vlm = ChatVLM(model, processor, None, device, dtype, batch_size, setting="reward.options.unifiedreward")

    def _ask(self, requests: list[tuple[list, str]]) -> list[str]:
        """Answers to ``(images [3, H, W] list, text)`` requests."""
        chats = [(self.vlm.chat_text(len(ims), text), [self.vlm.image(im, self.resize) for im in ims])
                 for ims, text in requests]
        return self.vlm.generate(chats, seed=self.seed, **self.generation)

    def _ask_points(self, images: torch.Tensor, prompts: list[str], rows: list[tuple]) -> tuple[list[int], list[str]]:
        """The text-to-image rows (no source) and the judge's reply to each, asked with the point template."""
        todo = [i for i, r in enumerate(rows) if not r]
        return todo, self._ask([([images[i]], self.templates["point"].replace("{prompt}", prompts[i])) for i in todo])

    def pointwise(self, images: torch.Tensor, prompts: list[str], rows: list[tuple]) -> torch.Tensor:
        out = torch.full((len(prompts),), float("nan"))  # [B]: NaN for rows with a source
        todo, answers = self._ask_points(images, prompts, rows)
        for i, text in zip(todo, answers):
            s = point_score(text)
            if s is None:
                if self.on_invalid == "raise":
                    raise ValueError(f"unifiedreward: no 'Final Score: 1-5' in the judge's reply: {text[:200]!r}")
                log.warning("unifiedreward: no 'Final Score: 1-5' in the judge's reply; scoring it %s: %r",
                            self.on_invalid, text[:200])
                s = 0.0 if self.on_invalid == "zero" else float("nan")
            out[i] = s
        return out

    def by_dimension(self, images: torch.Tensor, prompts: list[str], rows: list[tuple]) -> torch.Tensor:
        """UnifiedReward-2.0's pointwise dimensions: ``sum_k w_k s_k / (5 sum_k w_k)`` per text-to-image row."""
        out = torch.full((len(prompts),), float("nan"))  # [B]: NaN for rows with a source
        todo, answers = self._ask_points(images, prompts, rows)
        total = sum(self.dimensions.values())
        for i, scores in zip(todo, dimension_scores(answers, list(self.dimensions))):
            out[i] = sum(w * scores[k] for k, w in self.dimensions.items()) / (5.0 * total)
        return out

    def pairwise(self, images: torch.Tensor, prompts: list[str], rows: list[tuple]) -> torch.Tensor:
        out = torch.full((len(prompts),), float("nan"))
        jobs = []  # (group, its local pairs, requests)
        for group in groups_of(prompts, rows):
            pairs = list(itertools.combinations(range(len(group)), 2))
            src, key = rows[group[0]], "edit_pair" if rows[group[0]] else "pair"
            text = self.templates[key].replace("{prompt}", prompts[group[0]])
            jobs.append((group, pairs, key, [([*src, images[group[a]], images[group[b]]], text) for a, b in pairs]))
        answers = iter(self._ask([r for *_, reqs in jobs for r in reqs]))
        for group, pairs, key, reqs in jobs:
            labels = ("edited image 1 is better", "edited image 2 is better") if key == "edit_pair" else \
                ("image 1 is better", "image 2 is better")
            rates = win_rates(len(group), pairs, [verdict(next(answers), labels) for _ in reqs])
            out[group] = torch.tensor(rates, dtype=torch.float32)
        return out

    def __call__(self, images: torch.Tensor, prompts: list[str], *, sources=None, **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        rows = sources_per_row(sources, len(prompts), "unifiedreward")
        how = {"pointwise": self.pointwise, "dimensions": self.by_dimension, "pairwise": self.pairwise}[self.mode]
        return how(images, prompts, rows)
