"""Fingerprint of training: every digits recipe and every sampler x update pair, two units each on a tiny
digits model, reduced to sha256 digests of every checkpoint tensor and every logged metric value.

A refactor that must keep behaviour runs this before and after and compares::

    OMP_NUM_THREADS=1 .venv/bin/python tools/fingerprint_runs.py --out /tmp/before.json
    # ... change the code ...
    OMP_NUM_THREADS=1 .venv/bin/python tools/fingerprint_runs.py --out /tmp/after.json --compare /tmp/before.json

Each case is a recipe plus overrides; the knobs that moved between the ``train`` section and an update's
``train.loss_options`` are given by name (:func:`option_overrides` writes them where this checkout keeps
them), so one case list runs on both sides of such a move. A combination that config validation refuses
is fingerprinted by its error message. Wall-clock figures (keys naming seconds) are left out of the
metrics; everything else a run logs or checkpoints is in. Cheap on purpose: a 1-layer random digits
model, 2 units, batches of 8, one process (set ``OMP_NUM_THREADS=1`` on a shared machine).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
SAMPLER_RECIPES = {"group": "digits", "branch": "digits_branch", "tempflow": "digits_tempflow", "sol": "digits_sol",
                   "sol_ode": "digits_sol_nft", "ode": "digits"}
ONLINE_LOSSES = ("grpo", "grpo_guard", "nft", "dpo", "gdro")
GRPO_FAMILY = ("grpo", "grpo_guard")  # share their loss options: switching between them keeps the recipe's
# per-sampler sizes: batch 8 is a multiple of every sampler's samples per prompt below
SIZES = {"group": {"sampler.group_size": 4, "sampler.num_steps": 3, "sampler.max_batch": "null"},
         "ode": {"sampler": "{name: ode, group_size: 4, num_steps: 3}"},
         "branch": {"sampler.num_steps": 3, "sampler.split_steps": "[0, 1]", "sampler.window": 2,
                    "sampler.window_start": 0, "sampler.max_batch": "null"},
         "tempflow": {"sampler.num_steps": 3, "sampler.branch_steps": "[0, 1]", "sampler.branches": 2,
                      "sampler.seeds_per_prompt": 1, "sampler.max_batch": "null"},
         "sol": {"sampler.pool_size": 6, "sampler.preview_steps": 2, "sampler.keep": 4,
                 "sampler.regen_options.num_steps": 3, "sampler.explore_batch": "null"}}
SIZES["sol_ode"] = SIZES["sol"]
TRAIN = {"train.iterations": 2, "train.batch_size": 8, "train.minibatch_size": 3, "train.grad_accum": 2,
         "train.inner_epochs": 2, "train.checkpoint_every": 1, "train.keep_checkpoints": 2, "train.lr": 3e-3,
         "train.ema": "true", "data.prompts": "[a handwritten digit 3, a handwritten digit 7]",
         "data.eval_prompts": "[a handwritten digit 5]", "data.eval_seeds_per_prompt": 2, "reward.heldout": "{}",
         "logging.eval_every": 100, "logging.image_every": 100, "logging.trackers": "[]", "logging.progress": "false"}
OFFLINE = {"offline.groups_per_prompt": 3, "offline.k": 3, "offline.num_steps": 3, "offline.eval_steps": 3,
           "offline.batch_groups": 1, "offline.epochs": 2, "offline.max_steps": 2, "offline.eval_every": 100,
           "offline.save_png": "false", "offline.judge": "{}", "offline.groups_per_shard": 2,
           "train.iterations": 2, "train.checkpoint_every": 1, "train.grad_accum": 2, "train.lr": 3e-3,
           "data.prompts": "[a handwritten digit 3, a handwritten digit 7]",
           "data.eval_prompts": "[a handwritten digit 5]", "data.eval_seeds_per_prompt": 2, "reward.heldout": "{}",
           "logging.eval_every": 100, "logging.image_every": 100, "logging.trackers": "[]", "logging.progress": "false"}


def cases() -> list[tuple[str, str, dict, dict]]:
    """``(id, recipe, overrides, options by name)``: every digits recipe, every sampler x online update."""
    out = []
    for recipe in sorted(p.stem for p in (ROOT / "recipes").glob("digits*.yaml")):
        if recipe == "digits_gdro":
            out.append(("recipe/digits_gdro", recipe, dict(OFFLINE), {}))
            continue
        sampler = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())["sampler"]["name"]
        out.append((f"recipe/{recipe}", recipe, {**SIZES[sampler], **TRAIN}, {}))
    for sampler, recipe in SAMPLER_RECIPES.items():
        for loss in ONLINE_LOSSES:
            ov = {**SIZES[sampler], **TRAIN, "train.loss": loss}
            opts: dict = {}
            if loss not in GRPO_FAMILY:  # a loss of another family: its own defaults, KL as below
                ov["train.loss_options"] = "{}"
                opts = {"beta_kl": 0.04 if loss == "nft" else 0.0}
            out.append((f"pair/{sampler}x{loss}", recipe, ov, opts))
    out.append(("extra/group-cfg-flowgrpo-kl", "digits",
                {**SIZES["group"], **TRAIN, "model.guidance_scale": 2.0},
                {"kl_form": "flow_grpo", "cfg_uncond_grad": True, "adv_clip_max": 2.0}))
    out.append(("extra/group-cfg-detached", "digits", {**SIZES["group"], **TRAIN, "model.guidance_scale": 2.0},
                {"cfg_uncond_grad": False}))
    return out


def option_overrides(loss: str, opts: dict) -> list[str]:
    """``train.K=v`` where this checkout's ``TrainConfig`` has ``K``, else ``train.loss_options.K=v`` where the
    update's options have it (a knob the update does not have is dropped: it would be unused)."""
    from flowrl.trainers.config import TrainConfig
    from flowrl.updates import UPDATES

    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    own = {f.name for f in dataclasses.fields(UPDATES.get(loss).Options)}
    out = []
    for k, v in opts.items():
        val = json.dumps(v) if not isinstance(v, bool) else str(v).lower()
        if k in train_keys:
            out.append(f"train.{k}={val}")
        elif k in own:
            out.append(f"train.loss_options.{k}={val}")
    return out


def _digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    head = str((t.dtype, tuple(t.shape))).encode()
    return hashlib.sha256(head + (t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")).hexdigest()


def _walk(obj, prefix: str, out: dict) -> None:
    """Digests of every tensor and number in a nested state (optimizer / scheduler / RNG state)."""
    if isinstance(obj, torch.Tensor):
        out[prefix] = _digest(obj)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            _walk(obj[k], f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}[{i}]", out)
    elif isinstance(obj, float):
        out[prefix] = obj.hex()
    elif isinstance(obj, (int, bool, str)) or obj is None:
        out[prefix] = repr(obj)


def _timing(key: str) -> bool:
    return "second" in key or key.endswith("_s") or "throughput" in key


def run_digest(run: Path) -> dict:
    """``{"checkpoints": {name: digest}, "metrics": [{key: value}]}`` of a finished run directory."""
    from safetensors.torch import load_file

    ck: dict = {}
    for d in sorted((run / "checkpoints").glob("iter_*")):
        for f in sorted(d.iterdir()):
            name = f"{d.name}/{f.name}"
            if f.suffix == ".safetensors":
                for k, t in sorted(load_file(str(f)).items()):
                    ck[f"{name}:{k}"] = _digest(t)
            elif f.suffix == ".pt":
                _walk(torch.load(f, weights_only=True), name, ck)
            elif f.suffix == ".json":
                _walk({k: v for k, v in json.loads(f.read_text()).items() if not _timing(k)}, name, ck)
    metrics = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        metrics.append({k: (v.hex() if isinstance(v, float) else v) for k, v in sorted(rec.items()) if not _timing(k)})
    return {"checkpoints": ck, "metrics": metrics}


def run_case(recipe: str, overrides: dict, opts: dict, model: Path, work: Path) -> dict:
    from flowrl.errors import ConfigError
    from flowrl.trainers.config import load_config
    from flowrl.trainers.offline import OfflineTrainer, generate_offline
    from flowrl.trainers.online import OnlineTrainer

    ov = [f"{k}={v}" for k, v in {"model.path": str(model), "model.device": "cpu", **overrides}.items()]
    if recipe == "digits_gdro":
        ov.append(f"offline.dataset={work / 'dataset'}")
    train = (yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text()).get("train") or {})
    loss = overrides.get("train.loss") or train.get("loss") or "grpo"
    try:
        cfg = load_config(recipe, ov + option_overrides(loss, opts))
    except ConfigError as e:
        return {"config_error": str(e)}
    torch.manual_seed(0)
    if cfg.train.mode == "offline":
        generate_offline(cfg, progress=False)
        OfflineTrainer(cfg, work / "run").train()
    else:
        OnlineTrainer(cfg, work / "run").train()
    return run_digest(work / "run")


def tiny_digits(path: Path) -> Path:
    """A random-init 1-layer digits model (the test suite's ``tiny_digits_dir``)."""
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines.digits import DigitsPolicy, DigitTextEncoder, tiny_transformer_config

    if not (path / "transformer").is_dir():
        torch.manual_seed(0)
        DigitsPolicy(SD3Transformer2DModel(**{**tiny_transformer_config(), "num_layers": 1}),
                     DigitTextEncoder()).save_pretrained(path)
    return path


def compare(now: dict, before: dict) -> list[str]:
    """One line per case whose fingerprint differs (or that one side lacks)."""
    lines = []
    for cid in sorted(set(now) | set(before)):
        a, b = now.get(cid), before.get(cid)
        if a == b:
            continue
        if a is None or b is None:
            lines.append(f"{cid}: only in {'before' if a is None else 'now'}")
            continue
        if "config_error" in a or "config_error" in b:
            lines.append(f"{cid}: {b.get('config_error', 'ran')!r} -> {a.get('config_error', 'ran')!r}")
            continue
        keys = sorted(k for k in set(a["checkpoints"]) | set(b["checkpoints"])
                      if a["checkpoints"].get(k) != b["checkpoints"].get(k))
        mets = [i for i, (x, y) in enumerate(zip(a["metrics"], b["metrics"])) if x != y]
        lines.append(f"{cid}: {len(keys)} checkpoint entries differ {keys[:3]}; metric lines differ {mets[:5]}"
                     + (f" {set(a['metrics'][mets[0]].items()) ^ set(b['metrics'][mets[0]].items())}" if mets else "")
                     + ("" if len(a["metrics"]) == len(b["metrics"]) else " (metric line counts differ)"))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="fingerprint JSON to write")
    ap.add_argument("--compare", help="an earlier fingerprint JSON: print the cases that differ, exit 1 if any")
    ap.add_argument("-k", default="", help="only the cases whose id contains this")
    args = ap.parse_args(argv)
    os.environ.setdefault("FLOWRL_HOME", str(Path(tempfile.gettempdir()) / "flowrl-fingerprint-home"))
    torch.set_num_threads(1)
    result = {}
    with tempfile.TemporaryDirectory(prefix="fingerprint-") as tmp:
        model = tiny_digits(Path(tmp) / "tiny-digits")
        for cid, recipe, ov, opts in cases():
            if args.k not in cid:
                continue
            t0 = time.perf_counter()
            work = Path(tmp) / cid.replace("/", "_")
            result[cid] = run_case(recipe, ov, opts, model, work)
            status = result[cid].get("config_error", "ran")
            print(f"{cid}: {status[:100]} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    ran = sum("config_error" not in v for v in result.values())
    print(f"{len(result)} cases ({ran} trained, {len(result) - ran} refused by validation) -> {args.out}")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        if args.k:
            before = {k: v for k, v in before.items() if args.k in k}
        diff = compare(result, before)
        print("\n".join(diff) if diff else f"bit-identical to {args.compare} ({len(result)} cases)")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
