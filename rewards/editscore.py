"""``editscore``: EditScore (Luo et al. 2025, arXiv 2509.23909), a Qwen-VL judge of instruction-guided edits.

An edit is (source image(s), instruction, result). Two questions per pass, as the authors' ``EditScore.evaluate``
asks them (package ``editscore`` 0.2, github VectorSpaceLab/EditScore):

* **SC** (semantic consistency): every source, then the result, with the prompt ``context + two-image edit rule
  + SC rule`` (:data:`CONTEXT`, :data:`EDIT_RULE`, :data:`SC_RULE`; every ``10`` of the SC rule replaced by
  ``score_range``, ``<instruction>`` by the instruction); the judge answers ``{"reasoning": ..., "score":
  [success, overediting]}``.
* **PQ** (perceptual quality): the result alone (``quality_images="result"``, ``evaluate``'s choice; ``"all"``
  shows the sources too, as the authors' vLLM ``batch_evaluate`` does) with ``context + PQ rule``;
  ``score: [naturalness, artifacts]``.

On Qwen2.5-VL checkpoints each prompt is wrapped in EditScore's own chat text (:func:`chat_text`: the Qwen
system turn, then ``<img1>: <vision>...<imgN>: <vision>`` and the prompt) and the images prepared as qwen-vl-utils
does; on Qwen3-VL ones, as its ``qwen3vl`` backend does, the processor's chat template and the images as they are
(:mod:`flowrl.rewards._qwen_vl`). Answered with EditScore's sampling (``temperature`` 0.7, top-p 0.9, top-k
20, 512 new tokens, ``torch.manual_seed(seed + pass)`` before each call; ``temperature=0``: greedy).

Scores (per pass ``i`` of ``num_pass``): ``SC = min(SC scores) / (score_range / 10)``, ``PQ = min(PQ scores) /
(score_range / 10)``, ``O = sqrt(SC x PQ)``, all on 0-10; ``overall`` = the mean of ``O`` over passes
(``reduction="average_last"``) or ``sqrt(mean SC x mean PQ)`` (``"average_first"``). **reward = overall / 10** in
[0, 1], what the authors' RL reward server returns (``O_score / 10``). A reply is parsed as their
``parse_vlm_output_to_dict`` does (:func:`parse_scores`); a reply with no score, or a score outside
``[0, score_range]``, is the scale's midpoint (5 of 10: their ``batch_evaluate``'s choice for an empty reply;
``on_invalid="nan"`` scores the row NaN, ``"raise"`` raises). Rows without a source are NaN (not an edit).

Checkpoints: ``model="Qwen/Qwen2.5-VL-7B-Instruct"`` with ``lora="EditScore/EditScore-7B"`` (the default; 72B:
``Qwen/Qwen2.5-VL-72B-Instruct`` + ``EditScore/EditScore-72B``), or the Qwen3-VL ones (``Qwen/Qwen3-VL-8B-Instruct`` +
``EditScore/EditScore-Qwen3-VL-8B-Instruct``). A 7B+ judge beside a training run is best served from its own
process and GPU: ``flowrl serve-reward editscore --options ...`` and the ``remote`` reward (docs/rewards.md).
"""
from __future__ import annotations

import json
import logging
import math
import re
from typing import Literal, Optional, Sequence

import torch

from flowrl.data.items import sources_per_row
from flowrl.options import Device, Fraction, ModelSource, NonNegativeFloat, NonNegativeInt, PositiveInt

from ._clip_common import DTypeLike, check_inputs
from ._qwen_vl import ChatVLM

log = logging.getLogger(__name__)

# EditScore's prompt parts (editscore/vie_prompts.py), verbatim: the model was trained on these words
CONTEXT = """You are a professional digital artist. You will have to evaluate the effectiveness of the AI-generated image(s) based on given rules.
All the input images are AI-generated. All human in the images are AI-generated too. so you need not worry about the privacy confidentials.

IMPORTANT: You will have to give your output in this way (Keep your reasoning concise and short.):
{
"reasoning" : "...",
"score" : [...]
}
"""
EDIT_RULE = """RULES:

Two images will be provided: The first being the original AI-generated image and the second being an edited version of the first.
The objective is to evaluate how successfully the editing instruction has been executed in the second image.

Note that sometimes the two images might look identical due to the failure of image edit.
"""
SC_RULE = """
From scale 0 to 10: 
A score from 0 to 10 will be given based on the success of the editing. (0 indicates that the scene in the edited image does not follow the editing instruction at all. 10 indicates that the scene in the edited image follow the editing instruction text perfectly.)
A second score from 0 to 10 will rate the degree of overediting in the second image. (0 indicates that the scene in the edited image is completely different from the original. 10 indicates that the edited image can be recognized as a minimal edited yet effective version of original.)
Put the score in a list such that output score = [score1, score2], where 'score1' evaluates the editing success and 'score2' evaluates the degree of overediting.

Editing instruction: <instruction>
"""  # noqa: W291 (the trailing spaces are the authors')
PQ_RULE = """RULES:

The image is an AI-generated image.
The objective is to evaluate how successfully the image has been generated.

From scale 0 to 10: 
A score from 0 to 10 will be given based on image naturalness. 
(
    0 indicates that the scene in the image does not look natural at all or give a unnatural feeling such as wrong sense of distance, or wrong shadow, or wrong lighting. 
    10 indicates that the image looks natural.
)
A second score from 0 to 10 will rate the image artifacts. 
(
    0 indicates that the image contains a large portion of distortion, or watermark, or scratches, or blurred faces, or unusual body parts, or subjects not harmonized. 
    10 indicates the image has no artifacts.
)
Put the score in a list such that output score = [naturalness, artifacts]
"""  # noqa: W291


def sc_prompt(instruction: str, score_range: int = 25) -> str:
    text = "\n".join([CONTEXT, EDIT_RULE, SC_RULE.replace("10", str(score_range))])
    return text.replace("<instruction>", instruction)


def pq_prompt(score_range: int = 25) -> str:
    return "\n".join([CONTEXT, PQ_RULE.replace("10", str(score_range))])


def chat_text(prompt: str, n_images: int) -> str:
    """EditScore's own chat text (its ``apply_chat_template``: numbered images, which the Qwen processors' template
    does not write)."""
    images = "".join(f"<img{i}>: <|vision_start|><|image_pad|><|vision_end|>" for i in range(1, n_images + 1))
    return (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{images}{prompt}"
            f"<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------- parsing (parse_vlm_output_to_dict's stages)
def _fix_quotes(s: str) -> str:
    s = re.sub(r"\bTrue\b", "true", re.sub(r"\bFalse\b", "false", re.sub(r"\bNone\b", "null", s)))
    try:
        json.loads(s.replace("'", '"'))
        return s.replace("'", '"')
    except json.JSONDecodeError:
        return re.sub(r"([\{\s,])(\w+)\s*:", r'\1"\2":', s)


def _escape_reasoning(s: str) -> str:
    return re.sub(r'("reasoning"\s*:\s*")(.*?)(?="\s*[,}])', lambda m: m.group(1) + m.group(2).replace('"', '\\"'),
                  s, flags=re.DOTALL)


def _scores_of(data) -> Optional[list[float]]:
    """The ``score`` list of a parsed reply (None: not a reply dict with a reasoning or a score)."""
    if not isinstance(data, dict):
        return None
    reasoning = next((data[k] for k in ("reasoning", "reason", "rationale") if isinstance(data.get(k), str)), "")
    value = data.get("score", [])
    scores = [float(s) for s in value if isinstance(s, (int, float, str))] if isinstance(value, list) else \
        [float(value)] if isinstance(value, (int, float)) else []
    return scores if (reasoning or scores) else None


def parse_scores(text: str) -> list[float]:
    """The scores of one EditScore reply (``[]``: none), by the stages of the authors' ``parse_vlm_output_to_dict``:
    the outermost ``{...}`` as JSON, then with quotes / keywords fixed, then with the reasoning's inner quotes
    escaped, then every number after ``"score":``. (A score string that is not a number moves on to the next
    stage here; there it raised.)"""
    if not text or not text.strip():
        return []
    found = re.search(r"\{.*\}", text, re.DOTALL)
    target = found.group(0) if found else text.strip()
    for fix in (lambda s: s, _fix_quotes, _escape_reasoning):
        try:
            scores = _scores_of(json.loads(fix(target)))
        except (json.JSONDecodeError, TypeError, ValueError):
            continue
        if scores is not None:
            return scores
    after = re.search(r"[\"']score[\"']\s*:\s*(.*)", target, re.DOTALL | re.IGNORECASE)
    return [float(n) for n in re.findall(r"[-+]?\d*\.?\d+", after.group(1) if after else target)]


class EditScore:
    """EditScore's overall / 10 per edit in [0, 1], float32 [B]; NaN for rows without a source (module doc)."""

    name = "editscore"
    needs_sources = True  # a row without a source is NaN (flowrl.conditions)
    resident_params = 8_292_166_656  # Qwen2.5-VL-7B-Instruct (LoRA merged), for `flowrl plan`
    resident_note = "Qwen/Qwen2.5-VL-7B-Instruct + EditScore/EditScore-7B merged (8.29B)"

    def __init__(self, model: ModelSource = "Qwen/Qwen2.5-VL-7B-Instruct",
                 lora: Optional[ModelSource] = "EditScore/EditScore-7B", processor: Optional[ModelSource] = None,
                 device: Device = "cpu", dtype: DTypeLike = "bfloat16", score_range: PositiveInt = 25,
                 num_pass: PositiveInt = 1, reduction: Literal["average_last", "average_first"] = "average_last",
                 temperature: NonNegativeFloat = 0.7, top_p: Fraction = 0.9, top_k: PositiveInt = 20,
                 max_new_tokens: PositiveInt = 512, seed: NonNegativeInt = 42, batch_size: PositiveInt = 8,
                 quality_images: Literal["result", "all"] = "result",
                 on_invalid: Literal["midpoint", "nan", "raise"] = "midpoint"):
        self.score_range, self.num_pass, self.reduction = int(score_range), int(num_pass), reduction
        self.seed, self.quality_images, self.on_invalid = int(seed), quality_images, on_invalid
        sampling = {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k)}
        self.generation = {"max_new_tokens": int(max_new_tokens), **(sampling if temperature > 0 else
                                                                   {"do_sample": False})}
        self.vlm = ChatVLM(model, processor, lora, device, dtype, batch_size, setting="reward.options.editscore")

    def requests(self, result: torch.Tensor, sources: Sequence[torch.Tensor], instruction: str) -> list[tuple]:
        """The SC and PQ requests ``(chat text, [PIL images])`` of one edit."""
        shown = [self.vlm.image(s) for s in (*sources, result)]
        quality = shown if self.quality_images == "all" else shown[-1:]
        chat = chat_text if self.vlm.uses_qwen_vl_utils else lambda text, n: self.vlm.chat_text(n, text)
        return [(chat(sc_prompt(instruction, self.score_range), len(shown)), shown),
                (chat(pq_prompt(self.score_range), len(quality)), quality)]

    def scale(self, text: str) -> float:
        """``min(scores) / (score_range / 10)`` of one reply, on 0-10 (an invalid reply: ``on_invalid``)."""
        scores = parse_scores(text)
        if scores and all(0 <= s <= self.score_range for s in scores):
            return min(scores) / (self.score_range / 10)
        if self.on_invalid == "raise":
            raise ValueError(f"editscore: no score in [0, {self.score_range}] in the judge's reply: {text[:200]!r}")
        log.warning("editscore: no score in [0, %d] in the judge's reply; scoring it %s: %r", self.score_range,
                    self.on_invalid, text[:200])
        return 5.0 if self.on_invalid == "midpoint" else float("nan")

    def overall(self, sc: list[float], pq: list[float]) -> float:
        """One edit's overall score on 0-10 from its per-pass SC and PQ (module doc)."""
        if self.reduction == "average_first":
            return math.sqrt((sum(sc) / len(sc)) * (sum(pq) / len(pq)))
        return sum(math.sqrt(a * b) for a, b in zip(sc, pq)) / len(sc)

    def __call__(self, images: torch.Tensor, prompts: list[str], *, sources=None, **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        rows = sources_per_row(sources, len(prompts), "editscore")
        todo = [i for i, r in enumerate(rows) if r]
        out = torch.full((len(prompts),), float("nan"))
        if not todo:
            return out
        requests = [q for i in todo for q in self.requests(images[i], rows[i], prompts[i])]  # SC, PQ per edit
        sc, pq = [[] for _ in todo], [[] for _ in todo]
        for p in range(self.num_pass):
            answers = self.vlm.generate(requests, seed=self.seed + p, **self.generation)
            for j in range(len(todo)):
                sc[j].append(self.scale(answers[2 * j]))
                pq[j].append(self.scale(answers[2 * j + 1]))
        for j, i in enumerate(todo):
            out[i] = self.overall(sc[j], pq[j]) / 10
        return out
