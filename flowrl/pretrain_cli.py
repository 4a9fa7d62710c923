"""``flowrl pretrain-digits`` / ``flowrl pretrain-shapes``: pretrain (and cache) an embedded world's base model
(:class:`flowrl.pipelines.pixel_flow.PixelFlowPolicy`), then measure its sample report."""
from __future__ import annotations

import json
from dataclasses import fields
from importlib import import_module
from pathlib import Path

from .command_line import decay, example, non_negative_int, positive_float, positive_int

# verb -> (pipeline name, its settings class in flowrl.pipelines.pretrain_config, what its base learns from)
WORLDS = {"pretrain-digits": ("digits", "PretrainConfig", "scikit-learn's digits"),
          "pretrain-shapes": ("shapes", "ShapesPretrainConfig", "the shapes world's training prompts")}
VERBS = tuple(WORLDS)


def pretrain_command(a) -> dict:
    from flowrl.pipelines import policy_class
    from flowrl.pipelines.pixel_flow import base_lock

    pipeline, config_name, _ = WORLDS[a.command]
    cls = policy_class(pipeline)
    config_class = getattr(import_module("flowrl.pipelines.pretrain_config"), config_name)
    out = Path(a.out) if a.out else cls.default_base_path()
    with base_lock(out, cls.kind):  # a second command started at the same time waits, then finds the base
        if (out / "transformer").is_dir() and not a.force:
            print(f"[flowrl] {cls.kind} base already at {out} (use --force to retrain)")
        else:
            given = {f.name: getattr(a, f.name) for f in fields(config_class)  # the settings given as flags
                     if getattr(a, f.name, None) is not None}
            cls.pretrain(out, config_class(**given))
        module, function = cls.report.split(":")
        report = getattr(import_module(module), function)(out, force=a.force)
    pretrained = json.loads((out / "pretrain.json").read_text()) if (out / "pretrain.json").is_file() else None
    return {**report, "model": str(out), "pretrain": pretrained}


def add_pretrain_parsers(sub) -> None:
    """`flowrl pretrain-<world>`: pretrain the tiny base model of each embedded world."""
    settings = import_module("flowrl.pipelines.pretrain_config")
    for verb, (world, config_name, data) in WORLDS.items():
        default = {f.name: f.default for f in fields(getattr(settings, config_name))}
        pt = sub.add_parser(verb, help=f"pretrain (and cache) the tiny offline {world} base model ({data})",
                            epilog=example(f"flowrl {verb}", f"flowrl {verb} --out /tmp/{world} --steps 100"))
        pt.add_argument("--out", default=None, help=f"directory (default: the cached {world} base that runs load, "
                                                         f"$FLOWRL_HOME/{world}-base-vN)")
        pt.add_argument("--steps", type=positive_int, default=None,
                        help=f"training steps (default: {default['steps']})")
        pt.add_argument("--batch-size", type=positive_int, default=None,
                        help=f"images per step (default: {default['batch_size']})")
        pt.add_argument("--lr", type=positive_float, default=None,
                        help=f"AdamW learning rate (default: {default['lr']:g})")
        pt.add_argument("--seed", type=int, default=0)
        pt.add_argument("--ema", type=decay, default=None,
                        help=f"decay of the weights' moving average that is saved, in [0, 1); 0: the last weights "
                             f"(default: {default['ema']:g})")
        pt.add_argument("--t-mean", type=float, default=None,
                        help=f"mean of the logit-normal training times; below 0: more training at low noise "
                             f"(default: {default['t_mean']:g})")
        pt.add_argument("--warmup", type=non_negative_int, default=None,
                        help=f"warm-up steps before the cosine decay (default: {default['warmup']})")
        pt.add_argument("--init", default=None,
                        help=f"continue from a saved base instead of random weights: a directory, or a cached "
                             f"{world} base's folder name (pretrained first when missing)")
        pt.add_argument("--max-seconds", type=positive_float, default=None, help="stop training after this long")
        pt.add_argument("--force", action="store_true",
                        help="retrain (and re-measure the sample report) even if the directory holds a model")
        pt.set_defaults(fn=pretrain_command)
