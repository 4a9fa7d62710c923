"""Model adapters (shipped as ``flowrl.pipelines``): one file per model family, each a ``FlowPolicy``.

``build_policy(name, path, **kwargs)`` loads one by pipeline name; heavy modules load lazily.
What flowrl knows about a model (LoRA targets, the export writer, tiny offline components, ...)
is declared by its adapter class (``pipelines/base.py``); ``policy_class(name)`` finds that class
and ``tiny_kinds()`` collects the ``flowrl make-tiny`` kinds.
"""
from __future__ import annotations

import inspect
from typing import Callable

from flowrl.registry import Registry

# name -> "module:callable(path, **kwargs) -> FlowPolicy" (or the callable itself)
REGISTRY = Registry("pipeline", {
    "digits": "flowrl.pipelines.digits:load_digits_policy",
    "shapes": "flowrl.pipelines.shapes:load_shapes_policy",
    "sd3": "flowrl.pipelines.sd3:SD3Policy.from_pretrained",
    "flux": "flowrl.pipelines.flux:FluxPolicy.from_pretrained",
    "sana": "flowrl.pipelines.sana:SanaPolicy.from_pretrained",
    "qwen-image": "flowrl.pipelines.qwen_image:QwenImagePolicy.from_pretrained",
    "flux-kontext": "flowrl.pipelines.flux_kontext:FluxKontextPolicy.from_pretrained",
    "qwen-image-edit": "flowrl.pipelines.qwen_image_edit:QwenImageEditPolicy.from_pretrained",
    "wan": "flowrl.pipelines.wan:WanPolicy.from_pretrained",
    "flux2": "flowrl.pipelines.flux2:Flux2Policy.from_pretrained",
    "flux2-klein": "flowrl.pipelines.flux2_klein:Flux2KleinPolicy.from_pretrained",
    "z-image": "flowrl.pipelines.z_image:ZImagePolicy.from_pretrained",
    "wan2.2": "flowrl.pipelines.wan22:Wan22Policy.from_pretrained",
    "qwen-image-2.1": "flowrl.pipelines.qwen_image21:QwenImage21Policy.from_pretrained",
    "krea2": "flowrl.pipelines.krea2:Krea2Policy.from_pretrained",
    "ernie-image": "flowrl.pipelines.ernie_image:ErnieImagePolicy.from_pretrained",
    "hunyuan-image": "flowrl.pipelines.hunyuan_image:HunyuanImagePolicy.from_pretrained",
    "hunyuan-video-1.5": "flowrl.pipelines.hunyuan_video15:HunyuanVideo15Policy.from_pretrained",
    "ltx2": "flowrl.pipelines.ltx2:LTX2Policy.from_pretrained",
})


def available() -> list[str]:
    return REGISTRY.names()


def _loader(name: str) -> Callable:
    return REGISTRY.get(name)


def build_policy(name: str, path=None, **kwargs):
    """Load the policy of pipeline ``name`` from ``path`` (a directory or hub id)."""
    return _loader(name)(path, **kwargs)


def policy_class(name: str):
    """The adapter class of pipeline ``name``: the class of a ``Class.from_pretrained`` loader, or
    the return annotation of a loader function (``def load(path, **kw) -> MyPolicy``); None when
    the loader declares neither."""
    loader = _loader(name)
    owner = getattr(loader, "__self__", None)
    if isinstance(owner, type):
        return owner
    if isinstance(loader, type):
        return loader
    ret = inspect.signature(loader).return_annotation
    if isinstance(ret, str):
        ret = getattr(loader, "__globals__", {}).get(ret)
    return ret if isinstance(ret, type) and ret is not inspect.Signature.empty else None


def tiny_kinds() -> dict[str, type]:
    """``flowrl make-tiny`` kind -> the adapter class that builds it (every registered adapter's ``tiny_kinds``)."""
    kinds: dict[str, type] = {}
    for name in available():
        cls = policy_class(name)
        for kind in getattr(cls, "tiny_kinds", ()):
            kinds[kind] = cls
    return kinds
