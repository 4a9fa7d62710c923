"""Offline group datasets for GDRO (docs/algorithms.md §8): safetensors shards + a JSON index, written atomically.

Layout of a dataset directory::

    index.json                    format, generation spec, prompts, shard list, seconds spent
    shard-000000.safetensors      groups [start, start + count) of shard 0:
        x0            [n, k, C, H, W]  final latents (offline.latent_dtype)
        seeds         [n, k] int64     seed of each sample's initial noise (policy.initial_noise)
        group         [n] int64        global group id
        prompt_index  [n] int64        row of index.json "prompts"
        reward/<name> [n, k] float32   one column per reward scored at generation (NaN = n/a)
    shard-000000.reward-<name>.safetensors   a reward column added later (``add_reward_column``)
    png/g000123_s2.png            optional: image s of group 123

Group ``g`` is prompt ``g % P`` (round-robin, so any prefix covers every prompt) with the ``k``
seeds ``SeedSequence([seed, g])``: every group depends only on (spec, g), never on its
batch-mates. A shard file is written under a temporary name, fsynced and renamed; only then is
it added to ``index.json`` (itself replaced atomically). The index is the truth: files it does
not list are leftovers of an interrupted run and are overwritten, so a resumed run writes the
same groups, in the same shard layout, as an uninterrupted one, with none missing or duplicated.

The samples come from the deterministic sampler the caller hands over (``sample=``, the trainers
give ``flowrl.rollout.ode.ode_sample``) and the rewards are called through the reward call it hands
over too (``score=``, the trainers give :func:`flowrl.scoring.score_images`), so this module sits
beside the rest of ``flowrl.data`` and imports neither a sampler nor the reward call.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import save_file

from ..utils.images import to_uint8
from ..utils.io import atomic_write, save_png, write_text
from .items import item_record
from .offline_store import DTYPES, EXTENSIBLE, FORMAT, INDEX, VERSION, DatasetError, OfflineDataset, read_index

# the format, the index and the reader are offline_store's; this module writes datasets
__all__ = ["group_seeds", "group_prompt_index", "GenerationSettings", "SampleFn", "RewardCall", "iter_samples",
           "generate_dataset", "add_reward_column"]

# (policy, prompts, seeds, num_steps, solver=) -> (x0 [n, C, H, W], images [n, 3, H', W']): prompt i with seed
# i, deterministically (flowrl.rollout.ode.ode_sample)
SampleFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (reward, images [n, 3, H, W], prompts, frame_stride=) -> (total [n] float32, components): the reward call
# (flowrl.scoring.score_images)
RewardCall = Callable[..., tuple[torch.Tensor, dict]]


# ---------------------------------------------------------------- atomic shard files
def _atomic_save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: Optional[dict] = None) -> None:
    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    try:
        atomic_write(path, lambda tmp: save_file(cpu, str(tmp), metadata=metadata))
    except OSError as e:  # e.g. disk full: no partial shard is left, the index still lists only complete ones
        raise DatasetError(f"writing {path.name} failed ({e}); the dataset's complete shards are intact. Free disk "
                           f"space and rerun `flowrl generate-offline` with the same --out to continue.") from e


def _remove_leftovers(root: Path) -> None:
    for p in root.glob(".*.tmp-*"):
        p.unlink(missing_ok=True)


# ---------------------------------------------------------------- group identity
def group_seeds(seed: int, group: int, k: int) -> list[int]:
    """The ``k`` 31-bit sample seeds of group ``group`` (numpy ``SeedSequence([seed, group])``)."""
    return [int(s) & 0x7FFFFFFF for s in np.random.SeedSequence([int(seed), int(group)]).generate_state(k)]


def group_prompt_index(group: int, num_prompts: int) -> int:
    """Prompt row of group ``group``: round-robin over the prompts."""
    return int(group) % int(num_prompts)


@dataclass
class GenerationSettings:
    """How the reference model's groups are generated (stored in the index as the spec)."""

    k: int = 6
    groups_per_prompt: int = 1
    sampler: str = "euler"          # deterministic: "euler" (ODE) or "heun"
    num_steps: int = 20
    seed: int = 0
    groups_per_shard: int = 64
    generation_batch: int = 256     # images per sampler call (chunk boundaries are part of the spec)
    latent_dtype: str = "float32"
    save_png: bool = False

    def __post_init__(self):
        if self.k < 2 or self.groups_per_prompt < 1 or self.num_steps < 1 or self.groups_per_shard < 1 \
                or self.generation_batch < 1:
            raise ValueError(f"k must be >= 2 and groups_per_prompt, num_steps, groups_per_shard, generation_batch "
                             f">= 1; got {self}")
        if self.sampler not in ("euler", "heun"):
            raise ValueError(f"sampler must be 'euler' or 'heun', got {self.sampler!r}")
        if self.latent_dtype not in DTYPES:
            raise ValueError(f"latent_dtype must be one of {sorted(DTYPES)}, got {self.latent_dtype!r}")


# ---------------------------------------------------------------- deterministic generation
def iter_samples(policy, prompts: list, seeds: list[int], settings: GenerationSettings, sample: SampleFn
                 ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Deterministic samples of ``sample`` for rows ``(prompts[i], seeds[i])`` in chunks of
    ``settings.generation_batch`` rows (solver ``settings.sampler``): yields (first row, x0 [n, C, H, W]
    float32 on CPU, images [n, 3, H', W'] in [0, 1] on CPU). Only one chunk's images are alive at a time."""
    b = settings.generation_batch
    for a in range(0, len(prompts), b):
        x, im = sample(policy, prompts[a:a + b], seeds[a:a + b], settings.num_steps, solver=settings.sampler)
        yield a, x.float().cpu(), im.float().cpu()


def _score(score: RewardCall, rewards: Mapping[str, Callable], images: torch.Tensor, prompts: list,
           frame_stride: int) -> dict[str, torch.Tensor]:
    return {name: score(fn, images, prompts, frame_stride=frame_stride)[0]
            for name, fn in rewards.items()}  # name -> [N]


# ---------------------------------------------------------------- the index
def _write_index(root: Path, idx: dict) -> None:
    write_text(root / INDEX, json.dumps(idx, indent=1, sort_keys=True))


def _spec(settings: GenerationSettings, prompts: list[str], model: dict, reward_names: list[str]) -> dict:
    return {**asdict(settings), "model": dict(model), "num_prompts": len(prompts), "rewards": sorted(reward_names)}


def _spec_diff(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if k not in EXTENSIBLE and old.get(k) != new.get(k)]


def _shard_name(i: int) -> str:
    return f"shard-{i:06d}"


def _next_shard(idx: dict, total: int, per_shard: int) -> Optional[tuple[int, int, int]]:
    """(shard number, start group, count) of the next shard to write, or None when complete."""
    end = max((s["start"] + s["count"] for s in idx["shards"]), default=0)
    if end >= total:
        return None
    return len(idx["shards"]), end, min(per_shard, total - end)


def _drop_missing_shards(root: Path, idx: dict, evals_per_group: int) -> None:
    """Repair: from the first shard whose file was deleted (e.g. a damaged one), drop it and the
    shards after it from the index, so generation rewrites them (deterministically identical)."""
    shards = sorted(idx["shards"], key=lambda s: s["start"])
    for i, sh in enumerate(shards):
        if not all((root / f).is_file() for f in set(sh["columns"].values())):
            dropped = shards[i:]
            idx["shards"] = shards[:i]
            idx["model_evals"] -= sum(d["count"] for d in dropped) * evals_per_group
            return


# ---------------------------------------------------------------- writing
def _evals_per_sample(settings: GenerationSettings) -> int:
    """Model evaluations per generated sample: ``num_steps`` (Euler), ``2 * num_steps - 1`` (Heun)."""
    return settings.num_steps if settings.sampler == "euler" else 2 * settings.num_steps - 1


def _open_index(root: Path, prompts: list[str], reward_names: list[str], spec: dict) -> dict:
    """The index of the dataset in ``root``: a resumed one (checked against ``spec`` and ``prompts``;
    ``groups_per_prompt`` may grow, nothing else may change) or a fresh, empty one (``root`` created)."""
    if (root / INDEX).exists():
        idx = read_index(root)
        diff = _spec_diff(idx["spec"], spec)
        if idx["prompts"] != prompts:
            diff.append("prompts: the prompt list differs")
        if diff:
            raise DatasetError(f"{root} holds a dataset generated with other settings ({'; '.join(diff)}). "
                               f"Resume with the same settings, or choose another --out.")
        if spec["groups_per_prompt"] < idx["spec"]["groups_per_prompt"]:
            raise DatasetError(f"{root} has groups_per_prompt={idx['spec']['groups_per_prompt']}; a dataset can "
                               f"grow but not shrink (got {spec['groups_per_prompt']})")
        idx["spec"] = spec
        return idx
    if root.exists() and any(p for p in root.iterdir() if not p.name.startswith(".")):
        raise DatasetError(f"{root} exists and is not an offline dataset (no {INDEX}); choose an empty or new --out")
    root.mkdir(parents=True, exist_ok=True)
    return {"format": FORMAT, "version": VERSION, "spec": spec, "prompts": prompts, "shards": [],
            "latent_shape": None, "columns": ["x0", "seeds", "group", "prompt_index"] +
            [f"reward/{n}" for n in sorted(reward_names)], "generation_seconds": 0.0, "reward_seconds": 0.0,
            "model_evals": 0}


def _generate_shard(root: Path, policy, prompts: list, rewards: Mapping[str, Callable],
                    settings: GenerationSettings, start: int, count: int, sample: SampleFn, score: RewardCall,
                    frame_stride: int) -> tuple[dict[str, torch.Tensor], float, float]:
    """Sample and score groups ``[start, start + count)``; returns (shard tensors, generation
    seconds, reward seconds). Writes the groups' PNGs when ``settings.save_png``."""
    k = settings.k
    groups = list(range(start, start + count))
    pidx = [group_prompt_index(g, len(prompts)) for g in groups]
    seeds = [group_seeds(settings.seed, g, k) for g in groups]  # [n][k]
    rows_p = [prompts[p] for p in pidx for _ in range(k)]
    rows_s = [s for ss in seeds for s in ss]
    xs, parts, gen_s, rew_s = [], [], 0.0, 0.0
    t_gen = time.perf_counter()
    for first, x, images in iter_samples(policy, rows_p, rows_s, settings, sample):
        t_score = time.perf_counter()
        gen_s += t_score - t_gen
        parts.append(_score(score, rewards, images, rows_p[first:first + len(x)], frame_stride))  # name -> [n]
        if settings.save_png:
            _save_pngs(root, [(groups[(first + i) // k], (first + i) % k) for i in range(len(x))], images)
        xs.append(x.to(DTYPES[settings.latent_dtype]))
        t_gen = time.perf_counter()
        rew_s += t_gen - t_score
    x0 = torch.cat(xs)  # [n*k, C, H, W]
    tensors = {"x0": x0.view(count, k, *x0.shape[1:]),  # [n, k, C, H, W]
               "seeds": torch.tensor(seeds, dtype=torch.int64), "group": torch.tensor(groups, dtype=torch.int64),
               "prompt_index": torch.tensor(pidx, dtype=torch.int64),
               **{f"reward/{n}": torch.cat([q[n] for q in parts]).float().view(count, k) for n in rewards}}
    return tensors, gen_s, rew_s


def generate_dataset(out: str | os.PathLike, policy, prompts: Sequence, rewards: Mapping[str, Callable],
                     settings: GenerationSettings, *, sample: SampleFn, score: RewardCall, model: Optional[dict] = None,
                     max_new_shards: Optional[int] = None, progress: bool = True,
                     on_shard: Optional[Callable[[int], None]] = None, frame_stride: int = 1) -> dict:
    """Generate (or resume, or extend) the dataset in ``out``; returns its index.

    ``policy``: the reference model (``FlowPolicy``), sampled by ``sample`` (:data:`SampleFn`:
    ``flowrl.rollout.ode.ode_sample``). ``rewards``: name -> reward callable, each called through ``score``
    (:data:`RewardCall`: ``flowrl.scoring.score_images``) and
    stored as column ``reward/<name>`` (videos scored every ``frame_stride``-th frame). ``model``: a description stored in the spec (pipeline,
    path, guidance) so a resume with another model is refused. A resume must use the same spec
    (except ``groups_per_prompt``, which may grow: new groups are appended). ``max_new_shards``
    stops after writing that many shards (a budget; rerun to continue).
    """
    from ..utils.progress import progress as progress_bar

    root = Path(out)
    prompts = list(prompts)
    if not prompts:
        raise DatasetError("generate_dataset needs at least one prompt")
    idx = _open_index(root, [item_record(p) for p in prompts], list(rewards),
                      _spec(settings, prompts, model or {}, list(rewards)))  # edit items keep their source
    _remove_leftovers(root)
    evals_per_sample = _evals_per_sample(settings)
    _drop_missing_shards(root, idx, settings.k * evals_per_sample)
    total = len(prompts) * settings.groups_per_prompt
    done_groups = sum(s["count"] for s in idx["shards"])
    bar = progress_bar(total=total, initial=done_groups, desc="generate groups", unit="group", disable=not progress)
    written = 0
    while (nxt := _next_shard(idx, total, settings.groups_per_shard)) is not None:
        if max_new_shards is not None and written >= max_new_shards:
            break
        number, start, count = nxt
        tensors, gen_s, rew_s = _generate_shard(root, policy, prompts, rewards, settings, start, count, sample, score,
                                                frame_stride)
        name = _shard_name(number) + ".safetensors"
        _atomic_save_tensors(tensors, root / name)
        if on_shard is not None:
            on_shard(number)  # tests: simulate a crash between the shard file and the index update
        idx["latent_shape"] = list(tensors["x0"].shape[2:])
        idx["shards"].append({"name": _shard_name(number), "start": start, "count": count,
                              "columns": {c: name for c in tensors}})
        idx["generation_seconds"] += gen_s
        idx["reward_seconds"] += rew_s
        idx["model_evals"] += count * settings.k * evals_per_sample
        _write_index(root, idx)
        written += 1
        bar.update(count)
    bar.close()
    return idx


def _save_pngs(root: Path, names: list[tuple[int, int]], images: torch.Tensor) -> None:
    """``png/g{group}_s{sample}.png`` for each (group, sample) in ``names`` and image [3, H, W]."""
    for (g, j), im in zip(names, images):
        save_png(to_uint8(im).permute(1, 2, 0).cpu().numpy(), root / "png" / f"g{g:06d}_s{j}.png")  # [H, W, 3]


def add_reward_column(path: str | os.PathLike, name: str, reward: Callable, decode: Callable[[torch.Tensor], torch.Tensor],
                      batch_images: int = 256, overwrite: bool = False, progress: bool = True,
                      frame_stride: int = 1, *, score: RewardCall) -> dict:
    """Score every stored image with ``reward`` through ``score`` (:data:`RewardCall`:
    ``flowrl.scoring.score_images``) and add column ``reward/<name>`` (no regeneration).

    ``decode``: latents ``[B, C, H, W]`` -> images ``[B, 3, H', W']`` in [0, 1] (the policy's
    ``decode``; videos scored every ``frame_stride``-th frame). Each shard's column goes to its own file ``shard-NNNNNN.reward-<name>.safetensors``,
    written atomically, then the index is updated: an interrupted rescore resumes at the first
    shard without the column. ``overwrite`` rescores shards that already have it.
    """
    from ..utils.progress import progress as progress_bar

    root = Path(path)
    idx = read_index(root)
    col = f"reward/{name}"
    _remove_leftovers(root)
    if not overwrite and all(col in s["columns"] for s in idx["shards"]) and idx["shards"]:
        raise DatasetError(f"{root} already has column {col!r}; rescore it with --overwrite (overwrite=True)")
    ds = OfflineDataset(root)
    for s in progress_bar(idx["shards"], desc=f"score {name}", disable=not progress):
        if col in s["columns"] and not overwrite:
            continue
        t0 = time.perf_counter()
        batch = ds.read(list(range(s["start"], s["start"] + s["count"])), rewards=[])
        n, k = batch.x0.shape[:2]
        flat = batch.x0.flatten(0, 1)  # [n*k, C, H, W]
        prompts = [p for p in batch.prompts for _ in range(k)]
        vals = []
        for a in range(0, flat.shape[0], batch_images):
            with torch.no_grad():
                images = decode(flat[a:a + batch_images]).float().cpu()
            vals.append(_score(score, {name: reward}, images, prompts[a:a + batch_images], frame_stride)[name])
        fname = f"{s['name']}.reward-{_safe(name)}.safetensors"
        _atomic_save_tensors({col: torch.cat(vals).view(n, k)}, root / fname)
        s["columns"][col] = fname
        if col not in idx["columns"]:
            idx["columns"].append(col)
        idx["reward_seconds"] += time.perf_counter() - t0
        _write_index(root, idx)
    ds.close()
    return idx


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
