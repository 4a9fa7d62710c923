"""``flowrl`` command line: parse, build, call. No logic lives here."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _train(a) -> int:
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train

    cfg = load_config(a.config, a.overrides)
    summary = train(cfg, a.output_dir, resume=a.resume)
    print(json.dumps(summary, indent=2))
    return 0


def _pretrain(a) -> int:
    from flowrl.pipelines.digits import PretrainConfig, default_base_path, pretrain_digits, sample_grid_report

    out = Path(a.out) if a.out else default_base_path()
    if (out / "transformer").is_dir() and not a.force:
        print(f"[flowrl] digits base already at {out} (use --force to retrain)")
    else:
        given = {k: getattr(a, k) for k in ("steps", "batch_size", "lr", "seed", "max_seconds") if getattr(a, k) is not None}
        summary = pretrain_digits(out, PretrainConfig(**given))
        print(json.dumps(summary, indent=2))
    print(json.dumps(sample_grid_report(out, out / "samples.png"), indent=2))
    return 0


def _sample(a) -> int:
    from flowrl.sampling_cli import sample_command

    return sample_command(a)


def _eval(a) -> int:
    from flowrl.sampling_cli import eval_command

    return eval_command(a)


def _make_tiny(a) -> int:
    from flowrl.pipelines.tiny import make_tiny

    print(make_tiny(a.kind, a.out, overwrite=a.overwrite))
    return 0


def _export(a) -> int:
    from flowrl.export import export_run

    print(json.dumps(export_run(a.run_dir, a.out_dir, ema=a.ema, checkpoint=a.checkpoint,
                                model_path=a.model_path, overwrite=a.overwrite), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowrl", description="RL alignment of flow-matching image models")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="online RL training from a YAML recipe")
    t.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/digits.yaml")
    t.add_argument("--output-dir", required=True, help="run directory (checkpoints, metrics, images)")
    t.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its latest checkpoint")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 sampler.group_size=8")
    t.set_defaults(fn=_train)

    pt = sub.add_parser("pretrain-digits", help="pretrain (and cache) the tiny offline digits base model")
    pt.add_argument("--out", default=None, help="directory (default: $FLOWRL_HOME/digits-base-v1)")
    pt.add_argument("--steps", type=int, default=None)
    pt.add_argument("--batch-size", type=int, default=None)
    pt.add_argument("--lr", type=float, default=None)
    pt.add_argument("--seed", type=int, default=0)
    pt.add_argument("--max-seconds", type=float, default=None)
    pt.add_argument("--force", action="store_true", help="retrain even if the directory holds a model")
    pt.set_defaults(fn=_pretrain)

    s = sub.add_parser("sample", help="images from a base model or a trained run")
    s.add_argument("--config", default=None, help="recipe YAML (base model); or --run")
    s.add_argument("--run", default=None, help="a run directory: its config and latest checkpoint")
    s.add_argument("--prompts", nargs="+", required=True)
    s.add_argument("--per-prompt", type=int, default=8)
    s.add_argument("--steps", type=int, default=None, help="ODE steps (default: the sampler's)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True, help="PNG grid path")
    s.add_argument("overrides", nargs="*")
    s.set_defaults(fn=_sample)

    e = sub.add_parser("eval", help="mean reward of a run (or base model) on held-out prompts")
    e.add_argument("--config", default=None)
    e.add_argument("--run", default=None)
    e.add_argument("--prompts", nargs="*", default=None, help="default: the config's data.eval_prompts")
    e.add_argument("--per-prompt", type=int, default=16)
    e.add_argument("--steps", type=int, default=None)
    e.add_argument("--seed", type=int, default=12345)
    e.add_argument("--json", default=None, help="write the result here too")
    e.add_argument("overrides", nargs="*")
    e.set_defaults(fn=_eval)

    m = sub.add_parser("make-tiny", help="write a tiny random-weight SD3 or FLUX pipeline (offline smoke tests)")
    m.add_argument("kind", choices=["sd3", "flux", "flux-schnell"])
    m.add_argument("out")
    m.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    m.set_defaults(fn=_make_tiny)

    x = sub.add_parser("export", help="write a run's LoRA as a diffusers LoRA file (pipe.load_lora_weights(OUT_DIR))")
    x.add_argument("run_dir", help="a training run directory")
    x.add_argument("out_dir", help="output directory (absent or empty)")
    x.add_argument("--ema", action="store_true", help="export the EMA weights (runs with train.ema: true)")
    x.add_argument("--checkpoint", default=None, help="checkpoint directory or name (iter_NNNNNN); default: latest")
    x.add_argument("--model-path", default=None, help="base model, if not the run's model.path (reads its config)")
    x.add_argument("--overwrite", action="store_true", help="replace a previous export in out_dir")
    x.set_defaults(fn=_export)

    b = sub.add_parser("bench", help="benchmarks: ratios measured side by side in one run (JSON + table + PNG)")
    bsub = b.add_subparsers(dest="bench", required=True)
    from flowrl.bench.samplers import add_parsers as add_sampler_benches

    add_sampler_benches(bsub)
    from flowrl.bench.precision import add_precision_parser

    add_precision_parser(bsub)
    return p


def main(argv: list[str] | None = None) -> int:
    from flowrl.trainers.checkpoint import CheckpointError
    from flowrl.trainers.config import ConfigError
    from flowrl.trainers.online import TrainingStopped

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, CheckpointError, TrainingStopped, FileNotFoundError) as e:
        print(f"flowrl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
