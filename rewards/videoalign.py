"""``videoalign``: VideoReward (VideoAlign, Liu et al. 2025, arXiv 2501.13918), a Qwen2-VL-2B video reward model
with three heads read at three reward tokens: visual quality (VQ), motion quality (MQ), text alignment (TA).

reward = ``VQ + MQ + TA`` (``output: overall``, VideoAlign's ``Overall``) or one of them, each normalised with the
published checkpoint's ``inference_config`` (``(x - mean) / std``; ``normalize: false`` keeps the raw outputs),
as ``VideoVLMRewardInference.reward(..., use_norm=True)``.

Model: ``Qwen2VLForConditionalGeneration`` (config of ``Qwen/Qwen2-VL-2B-Instruct``) with ``<|VQ_reward|>``,
``<|MQ_reward|>``, ``<|TA_reward|>`` added to the tokenizer and a bias-free ``Linear(D, 1)`` head; the published
``checkpoint-11352/model.pth`` (hub ``KlingTeam/VideoReward``, formerly ``KwaiVGI/VideoReward``) is the PEFT
model's state dict: its LoRA (r 64, alpha 128 on the language model) is merged here (``lora_scaling`` =
alpha / r). Input: VideoAlign's ``detailed_special`` prompt, Qwen2-VL's chat template, the video sampled as
its ``vision_process.py`` does: ``smart_nframes`` at ``fps`` frames per second of a video of ``video_fps``
(uniform ``linspace`` indices), frames as 8-bit, resized with torchvision (bicubic, antialiased) to
``smart_resize(H, W, 28, min_pixels, max_pixels)``, then the base processor's normalisation.

A reward that takes videos whole (``takes_videos``): videos ``[B, 3, F, H, W]`` are scored as videos, not
frame by frame; an image ``[B, 3, H, W]`` (or a one-frame video) is scored as a still two-frame clip
(outside VideoAlign's training data: its MQ means little there).
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import nn

from flowrl.options import Device, ModelSource, PositiveFloat, PositiveInt, WeightsFile
from flowrl.utils.images import to_uint8

from ._clip_common import DTypeLike, check_inputs, chunks, require, resolve_dtype
from ._qwen2vl_rm import QwenVLReward, build_backbone, check_prompts, load_checkpoint, load_processor, smart_nframes, \
    uniform_indices
from ._qwen_vl import smart_resize
from .videoalign_prompt import DIMENSIONS, REWARD_TOKENS, videoalign_text

HUB_CHECKPOINT = "hf://KlingTeam/VideoReward/checkpoint-11352/model.pth"
CHECKPOINT_HINT = (f"Pass checkpoint={HUB_CHECKPOINT} (the KlingTeam/VideoReward Hugging Face repository; cached or "
                   f"downloaded) or checkpoint='/path/to/checkpoint-11352/model.pth'.")
# the published model_config.json's inference_config
NORM_MEAN = {"VQ": 3.6757, "MQ": 1.1646, "TA": 2.8105}
NORM_STD = {"VQ": 2.2476, "MQ": 1.3811, "TA": 2.5121}
MAX_PIXELS = 448 * 448  # data_config.max_frame_pixels (200704)
MIN_PIXELS = 128 * 28 * 28  # qwen-vl-utils' VIDEO_MIN_PIXELS (VideoAlign sets none)


class VideoAlign:
    """VideoReward's normalised ``VQ + MQ + TA`` (or one of them) per (video, prompt) pair; float32 [B] on CPU."""

    name = "videoalign"
    takes_videos = True
    resident_params = 2_208_563_200  # parameters kept loaded, for `flowrl plan` (bytes: x the dtype option)
    resident_note = "VideoReward = Qwen2-VL-2B with its LoRA merged (2.209B, counted on meta; LM head tied, not loaded)"

    def __init__(self, base: ModelSource = "Qwen/Qwen2-VL-2B-Instruct", checkpoint: WeightsFile = HUB_CHECKPOINT,
                 output: Literal["overall", "VQ", "MQ", "TA"] = "overall", normalize: bool = True,
                 video_fps: PositiveFloat = 16.0, fps: PositiveFloat = 2.0, num_frames: Optional[PositiveInt] = None,
                 max_pixels: PositiveInt = MAX_PIXELS, min_pixels: PositiveInt = MIN_PIXELS,
                 lora_scaling: PositiveFloat = 2.0, device: Device = "cpu", dtype: DTypeLike = "float32",
                 batch_size: PositiveInt = 2):
        if not checkpoint:
            raise ValueError(f"the videoalign reward needs its weights. {CHECKPOINT_HINT}")
        if min_pixels > max_pixels:
            raise ValueError(f"videoalign reward: min_pixels {min_pixels} is over max_pixels {max_pixels}")
        require("torchvision", "torchvision")
        self.device, self.dtype = torch.device(device), resolve_dtype(dtype)
        where = "reward.options.videoalign"
        backbone_sd, head_sd = load_checkpoint(checkpoint, "VideoReward checkpoint", CHECKPOINT_HINT,
                                               f"{where}.checkpoint", lora_scaling)
        self.processor, ids = load_processor(base, REWARD_TOKENS, f"{where}.base")
        backbone = build_backbone(base, len(self.processor.tokenizer), backbone_sd, f"{where}.base / checkpoint")
        if set(head_sd) != {"weight"} or head_sd["weight"].shape[0] != 1:
            raise ValueError(f"the checkpoint's rm_head is not VideoReward's Linear(D, 1) (keys {sorted(head_sd)})")
        head = nn.Linear(head_sd["weight"].shape[1], 1, bias=False)
        head.load_state_dict(head_sd)
        self.model = QwenVLReward(backbone, head, ids).eval().requires_grad_(False)
        self.model.backbone.to(self.device, self.dtype)
        self.model.head.to(self.device)
        self.output, self.normalize = output, bool(normalize)
        self.video_fps, self.fps, self.num_frames = float(video_fps), float(fps), num_frames
        self.max_pixels, self.min_pixels, self.batch_size = int(max_pixels), int(min_pixels), int(batch_size)

    def frames(self, video: torch.Tensor) -> torch.Tensor:
        """One video [3, F, H, W] in [0, 1] -> the sampled, resized 8-bit frames as float [F', 3, H', W'] (0-255)."""
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.functional import resize

        x = to_uint8(video.cpu()).permute(1, 0, 2, 3)  # [F, 3, H, W]
        total = x.shape[0]
        n = min(max(2, round(self.num_frames / 2) * 2), total) if self.num_frames else \
            smart_nframes(total, self.video_fps, self.fps)  # VideoAlign's nframes / fps modes
        x = x[uniform_indices(total, n)]  # [F', 3, H, W]
        h, w = smart_resize(x.shape[-2], x.shape[-1], min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return resize(x, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True).float()  # [F', 3, h, w]

    def batch(self, videos: torch.Tensor, prompts: list[str]) -> dict:
        """The processor's inputs for videos [b, 3, F, H, W] in [0, 1]."""
        clips = [self.frames(v) for v in videos]
        messages = [[{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": videoalign_text(p)}]}]
                    for p in prompts]
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.processor(text=text, videos=clips, padding=True, return_tensors="pt",
                              videos_kwargs={"do_resize": False, "do_sample_frames": False,
                                             "cap_pixels_per_frame": False})  # sizes are already the authors'

    @torch.no_grad()
    def scores(self, videos: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``{"VQ", "MQ", "TA", "overall"}`` float32 [B] each on CPU (normalised when ``normalize``)."""
        if isinstance(videos, torch.Tensor) and videos.ndim == 5 and videos.shape[1] == 3 and videos.shape[2] > 0:
            check_inputs(videos.flatten(2, 3), prompts, self.name)  # [B, 3, F H, W]: every frame's values, one pass
            if videos.shape[2] == 1:
                videos = videos.expand(-1, -1, 2, -1, -1)  # [B, 3, 2, H, W]: one frame as a still 2-frame clip
        else:
            check_inputs(videos, prompts, self.name)
            videos = videos[:, :, None].expand(-1, -1, 2, -1, -1)  # [B, 3, 2, H, W]: a still image as a 2-frame clip
        check_prompts(prompts, REWARD_TOKENS, self.name)
        out = []
        for s in chunks(videos.shape[0], self.batch_size):
            inputs = self.batch(videos[s], list(prompts[s])).to(self.device)
            out.append(self.model(inputs["input_ids"], inputs["attention_mask"],
                                  pixel_values_videos=inputs["pixel_values_videos"],
                                  video_grid_thw=inputs["video_grid_thw"])[..., 0].float().cpu())  # [b, 3]
        raw = torch.cat(out)  # [B, 3]: VQ, MQ, TA (the tokens' prompt order)
        res = {d: raw[:, i] for i, d in enumerate(DIMENSIONS)}
        if self.normalize:
            res = {d: (v - NORM_MEAN[d]) / NORM_STD[d] for d, v in res.items()}
        res["overall"] = res["VQ"] + res["MQ"] + res["TA"]
        return res

    def __call__(self, videos: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        return self.scores(videos, prompts)[self.output]
