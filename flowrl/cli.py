"""``flowrl`` command line: parse, build, call, and the one error boundary. No training logic lives here.

- Every verb's handler returns its result (a dict, printed as JSON; a string; or None). While it
  runs, ``sys.stdout`` is sent to stderr, so status lines (``[flowrl] ...``, progress) never mix
  with the result a script reads from stdout.
- A user mistake raises one of the types in :func:`flowrl.command_line.user_errors`; :func:`main`
  prints it as ONE line,
  ``flowrl VERB: error: ...``, and returns 2. Argument errors (argparse) have the same form and
  code. Any other exception is a bug: its traceback is kept (rc 1).
- Dotted overrides (``train.lr=3e-4``, ``"sampler={name: ode}"``) may stand anywhere on the line of a
  verb that takes them, also after an option; argparse abbreviations are off (``--budget`` is never
  read as ``--budget-seconds``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Optional

from .command_line import (OPTIONS_HELP, Parser, emit, example, positive_float, positive_int, require_device,
                           reward_options, split_overrides, user_message, verb_parser)
from .pretrain_cli import VERBS as PRETRAIN_VERBS
from .utils.threads import chosen_threads


# ---------------------------------------------------------------- the verbs
def _load_config(path, overrides):
    """The recipe with overrides, its device checked (a CUDA device without a GPU is a user error)."""
    from flowrl.trainers.config import load_config

    cfg = load_config(path, overrides)
    require_device(cfg.model.device)
    return cfg


def resume_command(argv: list[str]) -> str:
    """The ``flowrl train`` line that continues the run ``argv`` (the command's words after ``flowrl``)
    started: the same words, with ``--resume``."""
    words = list(argv) if "--resume" in argv else [*argv[:1], "--resume", *argv[1:]]
    return shlex.join(["flowrl", *words])


def _train(a) -> Optional[dict]:
    from flowrl.trainers.online import train

    if a.smoke:
        from flowrl.smoke import smoke_run

        summary = smoke_run(a.config, a.output_dir, a.overrides, resume=a.resume)
    else:
        cfg = _load_config(a.config, a.overrides)
        if cfg.train.mode == "offline":  # (train.mode sft is offline with train.loss sft)
            from flowrl.trainers.offline import train
        summary = train(cfg, a.output_dir, resume=a.resume)
    if summary and summary.get("stopped_by"):
        print(f"[flowrl] stopped early ({summary['stopped_by']}) with a checkpoint; continue with: "
              f"{resume_command(a.argv)}", file=sys.stderr, flush=True)
    return summary or None  # {} on a non-main rank: nothing to print


def _interrupted(args, argv: list[str]) -> str:
    """The one line for Ctrl-C outside a training loop (which checkpoints itself): for ``train``, whether
    the run directory holds a checkpoint to continue from, and the command that does."""
    if args.command != "train":
        return "interrupted (Ctrl-C)"
    from flowrl.checkpoints.common import list_checkpoints

    ckpts = list_checkpoints(Path(args.output_dir) / "checkpoints") if Path(args.output_dir, "checkpoints").is_dir() else []
    if not ckpts:
        return "interrupted (Ctrl-C) before a checkpoint was written; nothing to resume: run the same command again"
    return f"interrupted (Ctrl-C); the newest checkpoint is {ckpts[-1]}; continue with: {resume_command(argv)}"


def _generate_offline(a) -> dict:
    from flowrl.trainers.offline import generate_offline

    return generate_offline(_load_config(a.config, a.overrides), a.out, max_new_shards=a.max_shards)


def _rescore_offline(a) -> dict:
    from flowrl.registry import Registry
    from flowrl.rewards import available
    from flowrl.errors import ConfigError
    from flowrl.trainers.offline import rescore_offline

    try:
        Registry("reward", dict.fromkeys(available())).check(a.reward)
    except ValueError as e:
        raise ConfigError(f"--reward {a.reward}: {e}") from None
    options = reward_options(a.options)
    cfg = _load_config(a.config, a.overrides) if a.config else None
    if not Path(a.dataset).is_dir():
        raise ConfigError(f"--dataset {a.dataset}: no such directory; give a dataset written by flowrl generate-offline")
    return rescore_offline(a.dataset, a.reward, options, cfg=cfg, overwrite=a.overwrite)


def _sample(a) -> dict:
    from flowrl.sampling_cli import sample_command

    return sample_command(a)


def _eval(a):
    from flowrl.eval.arguments import harness_requested

    if harness_requested(a):  # a suite, a panel, a report or several models: flowrl.eval
        from flowrl.eval.command import eval_harness

        return eval_harness(a)
    from flowrl.sampling_cli import eval_command

    return eval_command(a)


def _make_tiny(a) -> str:
    from flowrl.pipelines import tiny_kinds
    from flowrl.pipelines.tiny import make_tiny
    from flowrl.errors import ConfigError

    kinds = sorted(tiny_kinds())  # declared by each pipeline adapter (tiny_kinds)
    if a.kind not in kinds:
        raise ConfigError(f"unknown kind {a.kind!r}; choose one of {', '.join(kinds)}")
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not a.overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose another directory or pass --overwrite "
                              f"to replace it")
    return str(make_tiny(a.kind, a.out, overwrite=a.overwrite))


def _export(a) -> dict:
    from flowrl.export import export_run

    info = export_run(a.run_dir, a.out_dir, ema=a.ema, checkpoint=a.checkpoint, model_path=a.model_path,
                      overwrite=a.overwrite)
    print(f"[flowrl] exported {info['weights']} weights of {info['checkpoint']} (iteration {info['iteration']}) "
          f"to {a.out_dir}")
    return info


# ---------------------------------------------------------------- the sub-parsers
def _add_weights_arguments(p: argparse.ArgumentParser) -> None:
    """``--checkpoint`` / ``--ema``: which of a run's weights ``sample``, ``eval`` and ``export`` use
    (the same default everywhere: the latest checkpoint's trained weights)."""
    p.add_argument("--checkpoint", default=None,
                   help="with a run: checkpoint directory or name (iter_NNNNNN); default: the latest")
    p.add_argument("--ema", action="store_true",
                   help="with a run: use its EMA weights (runs with train.ema: true; training evaluates with "
                        "them) instead of the trained ones (the default)")


def _add_model_arguments(p: argparse.ArgumentParser, repeatable: bool = False) -> None:
    """What ``sample`` and ``eval`` draw with: a recipe's base model or a run's weights, and the steps
    (``eval``: each repeatable, in order; flowrl.eval.arguments.ModelAction)."""
    extra = {}
    if repeatable:
        from flowrl.eval.arguments import ModelAction

        extra = {"action": ModelAction}
    again = "; repeatable, [LABEL=]PATH" if repeatable else ""
    p.add_argument("--config", default=None, help=f"recipe YAML (its base model); or --run{again}", **extra)
    p.add_argument("--run", default=None, help=f"a run directory: its config and (by default) latest checkpoint{again}",
                   **extra)
    _add_weights_arguments(p)
    p.add_argument("--steps", type=positive_int, default=None, help="ODE steps (default: the recipe sampler's)")


def _add_train_parser(sub) -> None:
    """`flowrl train`: online or offline RL training from a recipe."""
    from flowrl.updates import updates_help

    t = sub.add_parser("train", help="training from a YAML recipe (online RL; offline GDRO / DPO with "
                                     "train.mode=offline; SFT with train.mode=sft)",
                       epilog=example("flowrl train --config recipes/digits.yaml --output-dir runs/a train.lr=3e-4",
                                      "flowrl train --config recipes/digits.yaml --output-dir runs/a --resume "
                                      "train.lr=3e-4",
                                      "flowrl train --config recipes/sd3_group_pickscore.yaml --output-dir "
                                      "runs/smoke --smoke")
                       + "\n\n" + updates_help())
    t.add_argument("--config", required=True, help="recipe YAML or shipped recipe name, e.g. recipes/digits.yaml")
    t.add_argument("--output-dir", required=True, help="run directory (checkpoints, metrics, images)")
    t.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its latest "
                   "checkpoint (pass the same overrides as the first run)")
    t.add_argument("--smoke", action="store_true",
                   help="validate the recipe on this machine in a minute: the recipe's tiny random model "
                        "(make-tiny) and every size shrunk (flowrl/smoke.py); nothing is downloaded")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 sampler.group_size=8")
    t.set_defaults(fn=_train)


def _add_generate_offline_parser(sub) -> None:
    """`flowrl generate-offline`: write (or resume) a GDRO dataset."""
    g = sub.add_parser("generate-offline", help="GDRO dataset: k reference-model samples per prompt, scored",
                       epilog=example("flowrl generate-offline --config recipes/digits_gdro.yaml --out data/gdro"))
    g.add_argument("--config", required=True, help="recipe YAML with an offline section, e.g. recipes/digits_gdro.yaml")
    g.add_argument("--out", default=None, help="dataset directory (default: offline.dataset); an existing one resumes")
    g.add_argument("--max-shards", type=positive_int, default=None,
                   help="stop after writing this many shards (rerun to continue)")
    g.add_argument("overrides", nargs="*", help="dotted overrides, e.g. offline.k=6 offline.groups_per_prompt=4")
    g.set_defaults(fn=_generate_offline)


def _add_rescore_offline_parser(sub) -> None:
    """`flowrl rescore-offline`: add a reward column to a GDRO dataset."""
    rs = sub.add_parser("rescore-offline", help="add a reward column to a GDRO dataset without regenerating it",
                        epilog=example("flowrl rescore-offline --dataset data/gdro --reward jpeg_incompressibility"))
    rs.add_argument("--dataset", required=True, help="dataset directory written by generate-offline")
    rs.add_argument("--reward", required=True, help="reward name, e.g. ocr, pickscore, jpeg_compressibility")
    rs.add_argument("--options", nargs="*", default=[], help=OPTIONS_HELP)
    rs.add_argument("--config", default=None, help="recipe whose model decodes the latents (default: the dataset's)")
    rs.add_argument("--overwrite", action="store_true", help="rescore a column that already exists")
    rs.add_argument("overrides", nargs="*", help="dotted overrides of --config")
    rs.set_defaults(fn=_rescore_offline)


def _add_sample_parser(sub) -> None:
    """`flowrl sample`: an image grid from a base model or a run."""
    s = sub.add_parser("sample", help="images from a base model or a trained run",
                       epilog=example('flowrl sample --run runs/a --prompts "a handwritten digit 3" --out three.png',
                                      'flowrl sample --config recipes/digits.yaml --prompts "a handwritten digit 3" '
                                      '--out base.png',
                                      'flowrl sample --run runs/kontext --prompts "turn it into a 7" --source three.png '
                                      '--out seven.png'))
    _add_model_arguments(s)
    s.add_argument("--prompts", nargs="+", required=True, help="one or more prompts (quote each)")
    s.add_argument("--source", action="append", default=None, metavar="PATH",
                   help="editing models (flux-kontext, qwen-image-edit): a source image every prompt edits; repeat "
                        "for several, in order (picture 1, 2, ...)")
    s.add_argument("--per-prompt", type=positive_int, default=8, help="images per prompt (a row of the grid each)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True, help="PNG grid path")
    s.add_argument("overrides", nargs="*", help="dotted overrides of the recipe")
    s.set_defaults(fn=_sample)


def _add_eval_parser(sub) -> None:
    """`flowrl eval`: mean reward on held-out prompts."""
    e = sub.add_parser("eval", help="mean reward of a run (or base model) on held-out prompts; with --suite, "
                                    "--rewards, --out or several models: tables, intervals, paired deltas, a report",
                       epilog=example("flowrl eval --run runs/a --per-prompt 32",
                                      "flowrl eval --config recipes/digits.yaml --per-prompt 8 --json base.json",
                                      "flowrl eval --config base=recipes/digits.yaml --run runs/a --suite digits "
                                      "--rewards digits,jpeg_compressibility --per-prompt 8 --out report"))
    _add_model_arguments(e, repeatable=True)
    e.add_argument("--prompts", nargs="*", default=None, help="default: the config's data.eval_prompts")
    e.add_argument("--per-prompt", type=positive_int, default=16, help="samples per prompt")
    e.add_argument("--seed", type=int, default=12345)
    e.add_argument("--json", default=None, help="also write the result here")
    from flowrl.eval.arguments import add_harness_arguments

    add_harness_arguments(e)
    e.add_argument("overrides", nargs="*", help="dotted overrides of the recipe")
    e.set_defaults(fn=_eval)


def _add_make_tiny_parser(sub) -> None:
    """`flowrl make-tiny`: a tiny random-weight model for smoke tests."""
    m = sub.add_parser("make-tiny", help="write a tiny random-weight model (offline smoke tests)",
                       epilog=example("flowrl make-tiny sd3 /tmp/tiny-sd3"))
    # the kinds are declared by the pipeline adapters (``tiny_kinds``), checked when the command runs
    # (listing them here would import every adapter for every flowrl command)
    m.add_argument("kind", help="a tiny kind declared by a pipeline adapter (its tiny_kinds), e.g. sd3; "
                                "an unknown kind lists them all")
    m.add_argument("out", help="output directory (absent or empty)")
    m.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    m.set_defaults(fn=_make_tiny)


def _add_export_parser(sub) -> None:
    """`flowrl export`: a run's LoRA as a diffusers LoRA file."""
    x = sub.add_parser("export", help="write a run's LoRA as a diffusers LoRA file (pipe.load_lora_weights(OUT_DIR))",
                       epilog=example("flowrl export runs/a lora_out", "flowrl export runs/a lora_ema --ema"))
    x.add_argument("run_dir", help="a training run directory")
    x.add_argument("out_dir", help="output directory (absent or empty)")
    _add_weights_arguments(x)
    x.add_argument("--model-path", default=None, help="base model, if not the run's model.path (reads its config)")
    x.add_argument("--overwrite", action="store_true", help="replace a previous export in out_dir")
    x.set_defaults(fn=_export)


def _add_bench_parser(sub) -> None:
    """`flowrl bench`: the benchmark sub-verbs (each bench module adds its own)."""
    b = sub.add_parser("bench", help="benchmarks: ratios measured side by side in one run (table; JSON + PNG "
                                     "where asked)",
                       epilog=example("flowrl bench branch --pipeline digits --budget 120 --out bench"))
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from flowrl.bench import aggregate, host, methods, ocr, offline, precision_cli, reward, samplers

    for add in (samplers.add_parsers, methods.add_methods_parser, aggregate.add_aggregate_parser,
                precision_cli.add_precision_parser, offline.add_offline_parser, host.add_host_parser,
                reward.add_reward_parser, ocr.add_ocr_parser):
        add(bsub)
    for verb in bsub.choices.values():  # every bench verb: where it writes, checked before it measures anything
        verb.set_defaults(fn=_outputs_checked(verb.get_default("fn")))


def _outputs_checked(fn):
    """A bench verb's handler that first checks its output options (:func:`flowrl.bench.check_outputs`)."""
    def run(a):
        from flowrl.bench import check_outputs

        check_outputs(a)
        return fn(a)
    return run


def _add_serve_reward_parser(sub) -> None:
    """`flowrl serve-reward`: a reward in its own process behind HTTP (flowrl.rewards.server)."""
    x = sub.add_parser("serve-reward", help="serve a reward over HTTP for the `remote` reward (its own environment, "
                                            "GPU or node); prints the URL once ready")
    x.add_argument("name", help="a registered reward (flowrl.rewards.available()) or module:callable")
    x.add_argument("--options", nargs="*", default=[], help=OPTIONS_HELP)
    x.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    x.add_argument("--port", type=int, default=0, help="port (0: a free one, printed)")
    x.add_argument("--max-batch", type=int, default=64, help="images per reward call; concurrent requests merge up to it")
    x.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a request waits for others to merge with")
    x.add_argument("--max-request-mb", type=float, default=256.0, help="largest request body accepted (413 above)")
    x.add_argument("--token-env", default=None, help="environment variable holding a bearer token that /score requires")

    def run(a) -> int:
        from flowrl.rewards.server import ServeOptions, serve_reward_command
        from flowrl.errors import ConfigError

        try:
            opts = ServeOptions(host=a.host, port=a.port, max_batch=a.max_batch, max_wait=a.max_wait_ms / 1000,
                                max_request_mb=a.max_request_mb, token_env=a.token_env)
            opts.token()  # an unset --token-env fails here, before the reward loads
            require_device(reward_options(a.options).get("device"), "--options device")
            return serve_reward_command(a.name, a.options, opts)
        except (ValueError, ImportError) as e:
            raise ConfigError(str(e)) from None

    x.set_defaults(fn=run)


def _add_plan_parser(sub) -> None:
    """`flowrl plan`: the per-GPU memory plan of a recipe (flowrl.plan)."""
    from flowrl.plan.cli import add_plan_parser

    add_plan_parser(sub)
    sub.choices["plan"].epilog = example("flowrl plan --config recipes/sd3_group_pickscore.yaml --gpus 8 "
                                         "--gpu-memory 80GiB")


def build_parser() -> argparse.ArgumentParser:
    """The `flowrl` parser: one sub-command per verb, each added by its ``_add_<verb>_parser``."""
    p = Parser(prog="flowrl", description="RL alignment of flow-matching image models",
               epilog=example("flowrl train --config recipes/digits.yaml --output-dir runs/a", "flowrl VERB --help"))
    sub = p.add_subparsers(dest="command", required=True, metavar="VERB")
    from .dataset_cli import add_make_pairs_parser
    from .pretrain_cli import add_pretrain_parsers

    for add in (_add_train_parser, _add_generate_offline_parser, _add_rescore_offline_parser, add_make_pairs_parser,
                add_pretrain_parsers, _add_sample_parser, _add_eval_parser, _add_make_tiny_parser,
                _add_export_parser, _add_bench_parser, _add_plan_parser, _add_serve_reward_parser):
        add(sub)
    return p


# verbs whose handler prints its own output (flowrl plan: its table and JSON; flowrl serve-reward: its URL
# line once it serves, which a client or a launcher script reads from stdout)
_PRINTS_ITS_OWN = {"plan", "serve-reward"}
# verbs whose CPU work runs on the threads flowrl.utils.threads chooses (not the benchmarks: they time torch as set)
_CHOOSES_THREADS = {"train", "generate-offline", "rescore-offline", "make-pairs", *PRETRAIN_VERBS, "sample", "eval"}
# verbs that load diffusers models
_LOADS_MODELS = {"train", "generate-offline", "rescore-offline", *PRETRAIN_VERBS, "sample", "eval", "export", "bench"}


def main(argv: Optional[list[str]] = None) -> int:
    """Run one ``flowrl`` command line; returns the exit code (0, 2 for a user error)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, overrides = split_overrides(parser, argv)
    args, unknown = parser.parse_known_args(rest)
    args.argv = argv
    if unknown:  # named by the verb's own parser (argparse would blame the top-level one)
        verb_parser(parser, rest).error(f"unrecognized arguments: {' '.join(unknown)}")
    if overrides:
        args.overrides = [*overrides, *(args.overrides or [])]
    verb = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
    if not getattr(sys.stderr, "isatty", lambda: False)():  # a log: no carriage-return bars from the hub libraries
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if args.command in _LOADS_MODELS:  # (they import diffusers anyway; the others stay quick)
            import diffusers.utils.logging

            diffusers.utils.logging.disable_progress_bar()  # "Loading pipeline components...", pipeline calls
    try:
        if args.command in _PRINTS_ITS_OWN:
            return args.fn(args)
        threads = chosen_threads() if args.command in _CHOOSES_THREADS else contextlib.nullcontext()
        with contextlib.redirect_stdout(sys.stderr), threads:  # status lines to stderr: stdout holds the result
            result = args.fn(args)
        emit(result)
        return 130 if isinstance(result, dict) and result.get("stopped_by") == "SIGINT" else 0
    except BaseException as e:  # noqa: B036 (KeyboardInterrupt is a user action too)
        message = user_message(e) if not isinstance(e, SystemExit) else None
        if isinstance(e, KeyboardInterrupt):
            message = _interrupted(args, argv)
        if message is None:
            raise
        print(f"flowrl {verb}: error: {message}", file=sys.stderr, flush=True)
        return 130 if isinstance(e, KeyboardInterrupt) else 2


def run() -> None:
    """The ``flowrl`` console command: :func:`main`, then :func:`flowrl.utils.launch.finish` (a process a
    distributed launcher started skips interpreter finalization once its run is written)."""
    from flowrl.utils.launch import finish

    finish(main())


if __name__ == "__main__":
    run()
