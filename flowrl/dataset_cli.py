"""``flowrl make-pairs``: a ``flowrl generate-offline`` dataset turned into preference pairs for
``train.loss: dpo_offline`` (each group's best vs worst image by a stored reward column;
:func:`flowrl.trainers.offline.make_pairs`)."""
from __future__ import annotations

from pathlib import Path

from .command_line import example
from .errors import ConfigError


def make_pairs_command(a) -> dict:
    from flowrl.trainers.config import load_config
    from flowrl.trainers.offline import make_pairs

    if not Path(a.dataset).is_dir():
        raise ConfigError(f"--dataset {a.dataset}: no such directory; give a dataset written by flowrl generate-offline")
    cfg = load_config(a.config, a.overrides) if a.config else None
    return make_pairs(a.dataset, a.out, a.reward, cfg=cfg, keep_ties=a.keep_ties)


def add_make_pairs_parser(sub) -> None:
    """`flowrl make-pairs`: preference pairs (pairs.jsonl + PNGs) from a generate-offline dataset."""
    mp = sub.add_parser("make-pairs", help="preference pairs for train.loss=dpo_offline from a generate-offline "
                                           "dataset (each group's best vs worst image by a reward column)",
                        epilog=example("flowrl make-pairs --dataset data/gdro --reward digits --out data/pairs",
                                       "flowrl train --config recipes/digits_dpo_offline.yaml --output-dir runs/dpo "
                                       "data.dataset=data/pairs"))
    mp.add_argument("--dataset", required=True, help="dataset directory written by generate-offline")
    mp.add_argument("--out", required=True, help="folder for pairs.jsonl and the pairs' PNGs")
    mp.add_argument("--reward", required=True, help="the dataset's reward column that ranks each group")
    mp.add_argument("--config", default=None, help="recipe whose model decodes the latents (default: the dataset's)")
    mp.add_argument("--keep-ties", action="store_true", help="also pair groups whose best and worst tie")
    mp.add_argument("overrides", nargs="*", help="dotted overrides of --config")
    mp.set_defaults(fn=make_pairs_command)
