"""Rewards (shipped as ``flowrl.rewards``): a registry of named reward builders.

A reward is anything callable as ``reward(images [B, 3, H, W] in [0, 1], prompts) -> float32 [B]``
(NaN = not applicable). ``build(name, **kwargs)`` makes one by name; ``build_multi({name: weight})``
a weighted combination. Heavy reward models are imported lazily, on first build.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import torch

from flowrl.advantages.aggregate import RULES
from flowrl.registry import Registry

# name -> "module:attribute" (lazy: importing flowrl.rewards loads no reward model library), or a callable
REGISTRY = Registry("reward", {
    "digits": "flowrl.rewards.digits:DigitsReward",
    "digits_edit": "flowrl.rewards.digits_edit:DigitsEditReward",
    "jpeg_compressibility": "flowrl.rewards.compress:JpegCompressibility",
    "jpeg_incompressibility": "flowrl.rewards.compress:JpegIncompressibility",
    "pickscore": "flowrl.rewards.pickscore:PickScore",
    "clipscore": "flowrl.rewards.clip:CLIPScore",
    "aesthetic": "flowrl.rewards.aesthetic:LaionAesthetic",
    "hps": "flowrl.rewards.hps:HPSv21",
    "hpsv3": "flowrl.rewards.hpsv3:HPSv3",  # HPSv3: Qwen2-VL-7B + head (docs/rewards.md)
    "imagereward": "flowrl.rewards.imagereward:ImageReward",
    "ocr": "flowrl.rewards.ocr:OCRReward",
    "geneval": "flowrl.rewards.geneval:GenEval",  # GenEval's rules on a detector (docs/rewards.md)
    "vlm_judge": "flowrl.rewards.vlm:VLMJudge",
    "editscore": "flowrl.rewards.editscore:EditScore",  # in-process Qwen-VL judge of edits (docs/rewards.md)
    "unifiedreward": "flowrl.rewards.unifiedreward:UnifiedReward",  # pointwise or pairwise Qwen-VL judge
    "videoalign": "flowrl.rewards.videoalign:VideoAlign",  # VideoReward: Qwen2-VL-2B, VQ / MQ / TA (takes videos)
    "remote": "flowrl.rewards.remote:RemoteReward",  # served by `flowrl serve-reward`
})


class RewardUnavailable(RuntimeError):
    """A reward could not be reached (a reward server gone, a judge endpoint down) after its retries;
    the trainer stops at the iteration boundary and the run continues with ``--resume``."""


def register(name: str, target: Union[str, Callable]) -> None:
    """Add a reward builder: a ``"module:attr"`` string or a callable returning a reward."""
    REGISTRY.register(name, target)


def available() -> list[str]:
    return REGISTRY.names()


LABEL_MARK = "@"  # "geneval@official": the geneval reward again, under its own label (and options)


def registered_name(key: str) -> str:
    """The registered reward a configuration key names: ``NAME``, or ``NAME@LABEL`` for the same reward a
    second time under its own label and options (``reward.heldout: {geneval@official: {score: official}}``
    beside a trained ``geneval`` partial score; logged as ``eval/heldout/geneval@official``)."""
    return str(key).split(LABEL_MARK, 1)[0]


def check_name(key: str) -> None:
    """A ``ValueError`` naming the valid rewards when ``key`` (``NAME`` or ``NAME@LABEL``) names none, or when
    its label is empty."""
    name, mark, label = str(key).partition(LABEL_MARK)
    if mark and not label:
        raise ValueError(f"reward {key!r}: the label after {LABEL_MARK!r} is empty (write e.g. {name}@official)")
    REGISTRY.check(name)


def _resolve(name: str) -> Callable:
    return REGISTRY.get(registered_name(name))


def declared_options(name: str) -> tuple[dict, bool]:
    """``({option: flowrl.options.Option}, open)`` of reward ``name``: the annotated keyword parameters of what it
    registered (its class's constructor; types and ranges ride on the annotations); ``open`` when it takes
    ``**kwargs`` (keys beyond the declared ones are then not refused)."""
    from flowrl.options import declared

    return declared(_resolve(name))


def check_options(name: str, options: Optional[Mapping], where: str = "") -> None:
    """One ``ConfigError`` (a ``ValueError``) line for reward ``name``'s ``options`` (reported under ``where``, e.g.
    ``reward.options.hps``): an unknown key, a wrong type, a value out of range, or an option it needs (no
    default) left out. Loads nothing: config validation calls it before any model."""
    from flowrl.errors import ConfigError
    from flowrl.options import check_options as check

    declared_, is_open = declared_options(name)
    options = dict(options or {})
    try:
        check(where, f"the {name!r} reward", declared_, options, open=is_open)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    missing = [k for k, o in declared_.items() if o.required and k not in options]
    if missing:
        raise ConfigError(f"{name} reward: option {missing[0]!r} has no default; set it (e.g. reward.options.{name}: "
                          f"{{{missing[0]}: ...}}; docs/rewards.md)")


def resident(name: str, options: Optional[Mapping]) -> tuple[Optional[int], bool, str]:
    """``(bytes, on_gpu, note)`` reward ``name`` keeps loaded with ``options`` (``flowrl plan``): its class's
    ``resident_params`` x the bytes of its ``dtype`` option, on the side of its ``device`` option (each the
    declared default when not given); a class whose size depends on its options declares
    ``resident_for(options) -> (params or None, note)`` instead (e.g. ``geneval``'s detector and colour reader);
    ``(None, ..., why)`` when it declares no ``resident_params``."""
    target = _resolve(name)
    declared_, _ = declared_options(name)
    given = {k: o.default for k, o in declared_.items() if not o.required}
    given.update(options or {})
    size = 2 if str(given.get("dtype", "float32")) in ("bfloat16", "bf16", "float16", "fp16") else 4
    on_gpu = not str(given.get("device", "cpu")).startswith("cpu")
    if hasattr(target, "resident_for"):
        params, note = target.resident_for(given)
        return (None if params is None else int(params) * size), on_gpu, note
    params = getattr(target, "resident_params", None)
    if params is None:
        return None, on_gpu, (f"resident size unknown: not counted ({getattr(target, '__name__', name)} declares no "
                              f"resident_params)")
    return int(params) * size, on_gpu, str(getattr(target, "resident_note", ""))


def build(name: str, **kwargs):
    """Build the reward registered under ``name`` with ``kwargs`` (checked first: :func:`check_options`, the
    options named ``NAME.KEY``)."""
    check_options(name, kwargs, name)
    return _resolve(name)(**kwargs)


class MultiReward:
    """Weighted sum of named rewards; ``components`` keeps each one for logging and for
    per-reward advantage normalisation (MixGRPO ``advantage_aggr``).

    NaN in a component with non-zero weight makes the total NaN for that image (not applicable).
    ``aggregate``: ``reward.aggregate``, how the rewards are told apart where a sampler ranks samples itself
    (Sol-RL's kept subset: :func:`flowrl.advantages.ranking.ranking_values`); ``combine`` is the weighted
    sum either way. ``overlap``: samplers score each finished chunk while the next one samples (False: the serial
    path; ``flowrl.scoring``). ``frame_stride``: the stride ``flowrl.scoring.score_images`` scores
    videos ``[B, 3, F, H, W]`` with when its caller gives none (``reward.frame_stride``): every image
    reward on every n-th frame, averaged per video per component (:func:`flowrl.media.score_per_frame`,
    the one place frames are reduced), then combined; a reward that declares ``takes_videos`` gets the videos
    whole (:meth:`video_components`).
    """

    def __init__(self, rewards: Mapping[str, Callable], weights: Mapping[str, float], overlap: bool = True,
                 frame_stride: int = 1, aggregate: str = "sum"):
        if set(rewards) != set(weights):
            raise ValueError(f"rewards {sorted(rewards)} and weights {sorted(weights)} must name the same rewards")
        if not rewards:
            raise ValueError("MultiReward needs at least one reward")
        if aggregate not in RULES:
            raise ValueError(f"aggregate must be 'sum' or 'per_reward', got {aggregate!r}")
        self.aggregate = aggregate
        self.rewards, self.weights = dict(rewards), {k: float(v) for k, v in weights.items()}
        self.overlap = bool(overlap)
        if not isinstance(frame_stride, int) or isinstance(frame_stride, bool) or frame_stride < 1:
            raise ValueError(f"frame_stride must be a positive integer (score every n-th frame of a video), "
                             f"got {frame_stride!r}")
        self.frame_stride = frame_stride
        self.name = "+".join(f"{w:g}*{k}" for k, w in self.weights.items())

    def components(self, images: torch.Tensor, prompts: list[str], **meta) -> dict[str, torch.Tensor]:
        """Each reward's scores float32 ``[B]`` of images ``[B, 3, H, W]`` (videos go through
        ``flowrl.scoring.score_images``, which scores their frames with this)."""
        return {k: torch.as_tensor(r(images, prompts, **meta)).float().cpu() for k, r in self.rewards.items()}

    def video_components(self, images: torch.Tensor, prompts: list[str], frame_stride: int,
                         **meta) -> dict[str, torch.Tensor]:
        """Each reward's scores float32 ``[B]`` of images, or of videos ``[B, 3, F, H, W]``: a reward that takes
        videos whole (``takes_videos``, e.g. ``videoalign``) gets them as they are, the others every
        ``frame_stride``-th frame through :func:`flowrl.media.score_per_frame` (``flowrl.scoring`` calls this)."""
        from flowrl.media import is_video, score_per_frame

        whole = {k for k, r in self.rewards.items() if getattr(r, "takes_videos", False)} if is_video(images) else set()
        if not whole:
            return score_per_frame(self.components, images, prompts, frame_stride, **meta)
        return {k: torch.as_tensor(r(images, prompts, **meta)).float().cpu() if k in whole
                else score_per_frame(r, images, prompts, frame_stride, **meta) for k, r in self.rewards.items()}

    def combine(self, comps: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return sum(self.weights[k] * comps[k] for k in self.weights if self.weights[k] != 0) \
            if any(self.weights.values()) else torch.zeros_like(next(iter(comps.values())))

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        """The weighted total ``[B]`` of images, or of videos scored every ``frame_stride``-th frame."""
        return self.combine(self.video_components(images, prompts, self.frame_stride, **meta))


def build_multi(weights: Mapping[str, float], kwargs: Optional[Mapping[str, dict]] = None,
                overlap: bool = True, frame_stride: int = 1, aggregate: str = "sum") -> MultiReward:
    """``{name: weight}`` (+ per-name kwargs) -> :class:`MultiReward` (``aggregate``: ``reward.aggregate``)."""
    kwargs = kwargs or {}
    unknown = set(kwargs) - set(weights)
    if unknown:
        raise ValueError(f"reward options given for {sorted(unknown)}, which are not in the weights {sorted(weights)}")
    return MultiReward({k: build(k, **kwargs.get(k, {})) for k in weights}, weights, overlap=overlap,
                       frame_stride=frame_stride, aggregate=aggregate)
