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
    if cfg.train.mode == "offline":
        from flowrl.trainers.offline import train
    summary = train(cfg, a.output_dir, resume=a.resume)
    print(json.dumps(summary, indent=2))
    return 0


def _generate_offline(a) -> int:
    from flowrl.trainers.config import load_config
    from flowrl.trainers.offline import generate_offline

    cfg = load_config(a.config, a.overrides)
    print(json.dumps(generate_offline(cfg, a.out, max_new_shards=a.max_shards), indent=2))
    return 0


def _rescore_offline(a) -> int:
    from flowrl.trainers.config import load_config
    from flowrl.errors import ConfigError
    from flowrl.trainers.offline import rescore_offline

    try:
        options = json.loads(a.options) if a.options else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"--options must be a JSON object of the reward's keyword arguments ({e})") from None
    cfg = load_config(a.config, a.overrides) if a.config else None
    print(json.dumps(rescore_offline(a.dataset, a.reward, options, cfg=cfg, overwrite=a.overwrite), indent=2))
    return 0


def _pretrain(a) -> int:
    from flowrl.digits_report import sample_grid_report
    from flowrl.pipelines.digits import PretrainConfig, default_base_path, pretrain_digits

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
    from flowrl.pipelines import tiny_kinds
    from flowrl.pipelines.tiny import make_tiny

    kinds = sorted(tiny_kinds())  # declared by each pipeline adapter (tiny_kinds)
    if a.kind not in kinds:
        print(f"flowrl make-tiny: error: unknown kind {a.kind!r}; choose one of {', '.join(kinds)}", file=sys.stderr)
        return 2
    print(make_tiny(a.kind, a.out, overwrite=a.overwrite))
    return 0


def _export(a) -> int:
    from flowrl.export import export_run

    print(json.dumps(export_run(a.run_dir, a.out_dir, ema=a.ema, checkpoint=a.checkpoint,
                                model_path=a.model_path, overwrite=a.overwrite), indent=2))
    return 0


def _add_train_parser(sub) -> None:
    """`flowrl train`: online or offline RL training from a recipe."""
    t = sub.add_parser("train", help="RL training from a YAML recipe (online, or offline GDRO with train.mode=offline)")
    t.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/digits.yaml")
    t.add_argument("--output-dir", required=True, help="run directory (checkpoints, metrics, images)")
    t.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its latest checkpoint")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 sampler.group_size=8")
    t.set_defaults(fn=_train)


def _add_generate_offline_parser(sub) -> None:
    """`flowrl generate-offline`: write (or resume) a GDRO dataset."""
    g = sub.add_parser("generate-offline", help="GDRO dataset: k reference-model samples per prompt, scored")
    g.add_argument("--config", required=True, help="recipe YAML with an offline section, e.g. recipes/digits_gdro.yaml")
    g.add_argument("--out", default=None, help="dataset directory (default: offline.dataset); an existing one resumes")
    g.add_argument("--max-shards", type=int, default=None, help="stop after writing this many shards (rerun to continue)")
    g.add_argument("overrides", nargs="*", help="dotted overrides, e.g. offline.k=6 offline.groups_per_prompt=4")
    g.set_defaults(fn=_generate_offline)


def _add_rescore_offline_parser(sub) -> None:
    """`flowrl rescore-offline`: add a reward column to a GDRO dataset."""
    rs = sub.add_parser("rescore-offline", help="add a reward column to a GDRO dataset without regenerating it")
    rs.add_argument("--dataset", required=True, help="dataset directory written by generate-offline")
    rs.add_argument("--reward", required=True, help="reward name, e.g. ocr, pickscore, jpeg_compressibility")
    rs.add_argument("--options", default=None, help="the reward's keyword arguments as JSON, e.g. '{\"device\": \"cuda\"}'")
    rs.add_argument("--config", default=None, help="recipe whose model decodes the latents (default: the dataset's)")
    rs.add_argument("--overwrite", action="store_true", help="rescore a column that already exists")
    rs.add_argument("overrides", nargs="*")
    rs.set_defaults(fn=_rescore_offline)


def _add_pretrain_digits_parser(sub) -> None:
    """`flowrl pretrain-digits`: pretrain the tiny digits base model."""
    pt = sub.add_parser("pretrain-digits", help="pretrain (and cache) the tiny offline digits base model")
    pt.add_argument("--out", default=None, help="directory (default: $FLOWRL_HOME/digits-base-v1)")
    pt.add_argument("--steps", type=int, default=None)
    pt.add_argument("--batch-size", type=int, default=None)
    pt.add_argument("--lr", type=float, default=None)
    pt.add_argument("--seed", type=int, default=0)
    pt.add_argument("--max-seconds", type=float, default=None)
    pt.add_argument("--force", action="store_true", help="retrain even if the directory holds a model")
    pt.set_defaults(fn=_pretrain)


def _add_sample_parser(sub) -> None:
    """`flowrl sample`: an image grid from a base model or a run."""
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


def _add_eval_parser(sub) -> None:
    """`flowrl eval`: mean reward on held-out prompts."""
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


def _add_make_tiny_parser(sub) -> None:
    """`flowrl make-tiny`: a tiny random-weight model for smoke tests."""
    m = sub.add_parser("make-tiny", help="write a tiny random-weight model (offline smoke tests)")
    # the kinds are declared by the pipeline adapters (``tiny_kinds``), checked when the command runs
    # (listing them here would import every adapter for every flowrl command)
    m.add_argument("kind", help="a tiny kind declared by a pipeline adapter (its tiny_kinds), e.g. sd3; "
                                "an unknown kind lists them all")
    m.add_argument("out")
    m.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    m.set_defaults(fn=_make_tiny)


def _add_export_parser(sub) -> None:
    """`flowrl export`: a run's LoRA as a diffusers LoRA file."""
    x = sub.add_parser("export", help="write a run's LoRA as a diffusers LoRA file (pipe.load_lora_weights(OUT_DIR))")
    x.add_argument("run_dir", help="a training run directory")
    x.add_argument("out_dir", help="output directory (absent or empty)")
    x.add_argument("--ema", action="store_true", help="export the EMA weights (runs with train.ema: true)")
    x.add_argument("--checkpoint", default=None, help="checkpoint directory or name (iter_NNNNNN); default: latest")
    x.add_argument("--model-path", default=None, help="base model, if not the run's model.path (reads its config)")
    x.add_argument("--overwrite", action="store_true", help="replace a previous export in out_dir")
    x.set_defaults(fn=_export)


def _add_bench_parser(sub) -> None:
    """`flowrl bench`: the benchmark sub-verbs (each bench module adds its own)."""
    b = sub.add_parser("bench", help="benchmarks: ratios measured side by side in one run (JSON + table + PNG)")
    bsub = b.add_subparsers(dest="bench", required=True)
    from flowrl.bench.host import add_host_parser
    from flowrl.bench.offline import add_offline_parser
    from flowrl.bench.precision_cli import add_precision_parser
    from flowrl.bench.samplers import add_parsers as add_sampler_benches

    for add in (add_sampler_benches, add_precision_parser, add_offline_parser, add_host_parser):
        add(bsub)


def _add_plan_parser(sub) -> None:
    """`flowrl plan`: the per-GPU memory plan of a recipe (flowrl.plan)."""
    from flowrl.plan.cli import add_plan_parser

    add_plan_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    """The `flowrl` parser: one sub-command per verb, each added by its ``_add_<verb>_parser``."""
    p = argparse.ArgumentParser(prog="flowrl", description="RL alignment of flow-matching image models")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_train_parser, _add_generate_offline_parser, _add_rescore_offline_parser,
                _add_pretrain_digits_parser, _add_sample_parser, _add_eval_parser, _add_make_tiny_parser,
                _add_export_parser, _add_bench_parser, _add_plan_parser):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from flowrl.data.offline_store import DatasetError
    from flowrl.quant.common import BackendUnavailable
    from flowrl.checkpoints.common import CheckpointError
    from flowrl.errors import ConfigError
    from flowrl.trainers.steps import TrainingStopped

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, CheckpointError, TrainingStopped, DatasetError, FileNotFoundError, BackendUnavailable) as e:
        print(f"flowrl {args.command}: error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The ``flowrl`` console command: :func:`main`, then :func:`flowrl.utils.launch.finish` (a process a
    distributed launcher started skips interpreter finalization once its run is written)."""
    from flowrl.utils.launch import finish

    finish(main())


if __name__ == "__main__":
    run()
