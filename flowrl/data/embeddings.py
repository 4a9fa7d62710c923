"""Text-embedding cache for a fixed prompt set.

Training prompts are fixed, so each prompt's text conditioning is computed once (as DanceGRPO
precomputes its embeddings) and served from the cache afterwards; the text encoders can then be
dropped from memory (SD3.5's T5-XXL alone is ~9.5 GB in bf16). A cached row is exactly what
``policy.encode_prompts`` returned for the batch it was encoded in; the encoders themselves vary
with batch composition by float rounding (~1e-7 for SD3's CLIP pooled output), which the cache
removes: a prompt's conditioning no longer depends on its batch-mates.

Storage: in memory, or a directory of safetensors shards (``emb-00000.safetensors``, one row per
prompt per tensor) plus ``index.json``, read lazily with ``safe_open`` so a 25k-prompt set costs
disk, not RAM. Prompt-independent tensors (the negative prompt's embeddings under CFG) are found
by encoding two different probe prompts and stored once, not per row.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Optional

import torch

from ..utils.io import atomic_write, write_json
from .items import item_texts

INDEX = "index.json"
SHARED = "shared.safetensors"
TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")
_PROBES = ("a photo of a cat", "an oil painting of a harbour at night")


class TextCacheError(ValueError):
    """The cache cannot serve a request; the message says why and what to do."""


def model_fingerprint(model_cfg: dict) -> str:
    """A short hash of the model settings that change text embeddings (pipeline, path, guidance,
    options such as the negative prompt or max_sequence_length)."""
    keep = {k: model_cfg.get(k) for k in ("pipeline", "path", "guidance_scale", "options")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


class TextEmbeddingCache:
    """Per-prompt text conditioning, served in ``policy.encode_prompts``'s format.

    Build with :meth:`build` (or :meth:`open_or_build` for a directory), then :meth:`wrap` the
    policy with it. ``encode(prompts)`` returns batch-first tensors on ``device``.
    """

    def __init__(self, fingerprint: str = "", directory: Optional[Path] = None):
        self.fingerprint = fingerprint
        self.directory = Path(directory) if directory is not None else None
        self.shared: dict[str, torch.Tensor] = {}          # key -> [1, ...], prompt-independent
        self.keys: list[str] = []                          # per-row keys
        self._where: dict[str, tuple[int, int]] = {}       # prompt -> (shard, row)
        self._shards: list = []                            # dicts of [R, ...] tensors, or file names
        self._open: dict[int, object] = {}                 # lazily opened safetensors handles
        self.device = torch.device("cpu")

    # ---------------------------------------------------------------- building
    @classmethod
    def build(cls, policy, prompts: list[str], fingerprint: str = "", directory: Optional[str] = None,
              batch_size: int = 32, progress: bool = False) -> "TextEmbeddingCache":
        """Encode every distinct prompt of ``prompts`` with ``policy.encode_prompts`` (in batches of
        ``batch_size``); with ``directory`` the shards and index are written there atomically."""
        cache = cls(fingerprint, Path(directory) if directory else None)
        if cache.directory is not None:
            cache.directory.mkdir(parents=True, exist_ok=True)
        cache.device = getattr(policy, "device", torch.device("cpu"))
        cache.extend(policy.encode_prompts, prompts, batch_size=batch_size, progress=progress)
        return cache

    def _find_shared(self, encode: Callable, sample: list[str]) -> None:
        """Keys whose rows are equal for every probe and sample prompt are prompt-independent."""
        cond = encode(list(dict.fromkeys([*_PROBES, *sample[:4]])))  # [n, ...] per key
        self.keys = [k for k, v in cond.items() if not all(torch.equal(v[0], v[i]) for i in range(1, v.shape[0]))]
        self.shared = {k: v[:1].detach().cpu().contiguous() for k, v in cond.items() if k not in self.keys}

    def extend(self, encode: Callable, prompts: list[str], batch_size: int = 32, progress: bool = False,
               persist: bool = True) -> int:
        """Add the prompts not cached yet (one new shard per ``batch_size`` prompts). Returns how many.
        ``persist=False`` keeps the new shards in memory even when the cache has a directory."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        new = [p for p in dict.fromkeys(prompts) if p not in self._where]
        if not new:
            return 0
        if not self.keys and not self.shared:
            self._find_shared(encode, new)
        chunks = [new[i:i + batch_size] for i in range(0, len(new), batch_size)]
        if progress:
            from ..utils.progress import progress as progress_bar

            chunks = progress_bar(chunks, desc="text embeddings", unit="batch")
        for chunk in chunks:
            cond = encode(list(chunk))
            missing = set(self.keys) - set(cond)
            if missing:
                raise TextCacheError(f"encode_prompts stopped returning {sorted(missing)}; rebuild the cache")
            for k, v in self.shared.items():
                if not torch.equal(cond[k].detach().cpu(), v.expand_as(cond[k])):
                    raise TextCacheError(f"{k!r} looked prompt-independent but differs for {chunk[0]!r}; "
                                         f"this policy cannot use the text-embedding cache")
            rows = {k: cond[k].detach().cpu().contiguous() for k in self.keys}  # [R, ...] each
            idx = len(self._shards)
            self._shards.append(self._write_shard(idx, rows) if persist and self.directory else rows)
            for r, p in enumerate(chunk):
                self._where[p] = (idx, r)
        if persist and self.directory:
            self._write_index()
        return len(new)

    # ---------------------------------------------------------------- lookup
    def __contains__(self, prompt: str) -> bool:
        return prompt in self._where

    def __len__(self) -> int:
        return len(self._where)

    @property
    def prompts(self) -> list[str]:
        return list(self._where)

    def _rows(self, shard: int, rows: list[int]) -> dict[str, torch.Tensor]:
        s = self._shards[shard]
        if isinstance(s, dict):
            return {k: s[k][rows] for k in self.keys}
        if shard not in self._open:
            from safetensors import safe_open

            self._open[shard] = safe_open(str(self.directory / s), framework="pt")
        h = self._open[shard]
        return {k: torch.cat([h.get_slice(k)[r:r + 1] for r in rows]) for k in self.keys}

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``policy.encode_prompts(prompts)`` from the cache: batch-first tensors on ``self.device``.

        A prompt not in the cache is a :class:`TextCacheError` naming it."""
        prompts = list(prompts)
        unknown = [p for p in prompts if p not in self._where]
        if unknown:
            raise TextCacheError(f"prompt {unknown[0]!r} is not in the text-embedding cache ({len(self)} prompts) and "
                                 f"the text encoders were dropped; add it to data.prompts / data.eval_prompts, or set "
                                 f"model.drop_text_encoders=false")
        out: dict[str, list] = {k: [None] * len(prompts) for k in self.keys}
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for i, p in enumerate(prompts):
            s, r = self._where[p]
            by_shard.setdefault(s, []).append((i, r))
        for s, pairs in by_shard.items():
            got = self._rows(s, [r for _, r in pairs])
            for j, (i, _) in enumerate(pairs):
                for k in self.keys:
                    out[k][i] = got[k][j]
        cond = {k: torch.stack(v).to(self.device) for k, v in out.items()}  # [B, ...]
        n = len(prompts)
        cond.update({k: v.to(self.device).expand(n, *v.shape[1:]).clone() for k, v in self.shared.items()})  # [B, ...]
        return cond

    # ---------------------------------------------------------------- policy
    def wrap(self, policy, drop_encoders: bool = False) -> "CachedTextPolicy":
        """``policy`` with ``encode_prompts`` served from this cache (a :class:`CachedTextPolicy`;
        the policy object itself is not patched). Cached prompts come from the cache; others are
        encoded and added (kept in memory) while the encoders exist. ``drop_encoders`` removes the
        text encoders from the policy (and its diffusers pipeline) to free their memory; the number
        of parameters freed is the wrapper's ``freed_parameters``."""
        self.device = getattr(policy, "device", self.device)
        freed = drop_text_encoders(policy) if drop_encoders else 0
        return CachedTextPolicy(policy, self, encode_missing=not drop_encoders, freed_parameters=freed)

    def attach(self, policy, drop_encoders: bool = False) -> int:
        """Older in-place form of :meth:`wrap`: sets ``policy.encode_prompts`` (and
        ``policy.text_embedding_cache``) on the policy object itself; returns the parameters freed.
        Prefer :meth:`wrap`, which leaves the policy unpatched."""
        wrapped = self.wrap(policy, drop_encoders)
        policy.encode_prompts = wrapped.encode_prompts
        policy.text_embedding_cache = self
        return wrapped.freed_parameters

    def serve(self, prompts: list[str], encode: Optional[Callable] = None) -> dict[str, torch.Tensor]:
        """``encode(prompts)``'s conditioning from the cache; prompts not cached yet are first encoded
        with ``encode`` and kept in memory (None: they are a :class:`TextCacheError`)."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._where]
        if missing and encode is not None:
            self.extend(encode, missing, persist=False)  # late additions stay in memory
        return self.encode(prompts)

    # ---------------------------------------------------------------- files
    def _write_shard(self, idx: int, rows: dict[str, torch.Tensor]) -> str:
        from safetensors.torch import save_file

        name = f"emb-{idx:05d}.safetensors"
        atomic_write(self.directory / name, lambda tmp: save_file(rows, str(tmp)))
        return name

    def _write_index(self) -> None:
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        if self.shared and not (self.directory / SHARED).exists():
            shared = {k: v.contiguous() for k, v in self.shared.items()}
            atomic_write(self.directory / SHARED, lambda tmp: save_file(shared, str(tmp)))
        shards = [{"file": f, "prompts": [p for p, (s, _) in self._where.items() if s == i]}
                  for i, f in enumerate(self._shards) if isinstance(f, str)]
        doc = {"version": 1, "fingerprint": self.fingerprint, "keys": self.keys, "shared": sorted(self.shared),
               "shards": shards}
        write_json(doc, self.directory / INDEX, indent=None)

    @classmethod
    def load(cls, directory: str, fingerprint: Optional[str] = None) -> "TextEmbeddingCache":
        """Open a cache directory; ``fingerprint`` (if given) must match the one it was built with."""
        d = Path(directory)
        idx = d / INDEX
        if not idx.is_file():
            raise TextCacheError(f"{d} holds no text-embedding cache ({INDEX} missing)")
        doc = json.loads(idx.read_text())
        if fingerprint is not None and doc["fingerprint"] != fingerprint:
            raise TextCacheError(f"the text-embedding cache in {d} was built for a different model setting "
                                 f"(fingerprint {doc['fingerprint']} != {fingerprint}: pipeline, path, guidance or "
                                 f"options changed); delete the directory or point model.text_embedding_cache elsewhere")
        cache = cls(doc["fingerprint"], d)
        cache.keys = list(doc["keys"])
        if doc["shared"]:
            from safetensors.torch import load_file

            cache.shared = load_file(str(d / SHARED))
        for i, sh in enumerate(doc["shards"]):
            if not (d / sh["file"]).is_file():
                raise TextCacheError(f"text-embedding shard {d / sh['file']} is missing; delete {d} to rebuild the cache")
            cache._shards.append(sh["file"])
            for r, p in enumerate(sh["prompts"]):
                cache._where[p] = (i, r)
        return cache

    @classmethod
    def open_or_build(cls, policy, prompts: list[str], directory: str, fingerprint: str,
                      progress: bool = False) -> "TextEmbeddingCache":
        """Load ``directory`` (checking the fingerprint) and add any prompt not cached yet, or build it."""
        if (Path(directory) / INDEX).is_file():
            cache = cls.load(directory, fingerprint)
            cache.device = getattr(policy, "device", cache.device)
            cache.extend(policy.encode_prompts, prompts, progress=progress)
            return cache
        return cls.build(policy, prompts, fingerprint, directory, progress=progress)


def cache_directory(where: str | Path, fingerprint: str) -> Path:
    """Where the cache of the model setting ``fingerprint`` lives under ``model.text_embedding_cache``:
    the directory itself when it is new or holds that setting's cache, else its sub-directory named by
    the fingerprint, so the caches of different settings (a test on a tiny model, the real model) sit
    side by side instead of refusing each other."""
    d = Path(where)
    if not (d / INDEX).is_file() or json.loads((d / INDEX).read_text()).get("fingerprint") == fingerprint:
        return d
    return d / fingerprint


def drop_text_encoders(policy) -> int:
    """Remove the text encoders from ``policy`` (and its diffusers ``pipe``) to free their memory;
    returns the number of parameters freed."""
    freed = 0
    for obj in (policy, getattr(policy, "pipe", None)):
        for name in TEXT_ENCODER_NAMES:
            mod = getattr(obj, name, None) if obj is not None else None
            if isinstance(mod, torch.nn.Module):
                freed += sum(p.numel() for p in mod.parameters())
                setattr(obj, name, None)
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return freed


class CachedTextPolicy:
    """A policy whose ``encode_prompts`` is served by a :class:`TextEmbeddingCache`.

    Everything else is the wrapped policy's: attribute reads fall through to it and attribute
    writes go to it (so ``policy.transformer = model`` and
    ``flowrl.types.swapped_transformer(policy, module)`` change what ``policy.velocity`` runs).
    ``wrapped`` is the policy itself, ``text_embedding_cache`` the cache.
    """

    _OWN = ("wrapped", "text_embedding_cache", "freed_parameters", "_encode_uncached")

    def __init__(self, policy, cache: TextEmbeddingCache, encode_missing: bool = True, freed_parameters: int = 0):
        if isinstance(policy, CachedTextPolicy):  # one cache layer: the new cache replaces the old
            policy = policy.wrapped
        object.__setattr__(self, "wrapped", policy)
        object.__setattr__(self, "text_embedding_cache", cache)
        # the policy's own encoder, for prompts not cached yet (None: they are an error)
        object.__setattr__(self, "_encode_uncached", policy.encode_prompts if encode_missing else None)
        object.__setattr__(self, "freed_parameters", int(freed_parameters))

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning of ``prompts`` from the cache (see :meth:`TextEmbeddingCache.serve`)."""
        return self.text_embedding_cache.serve(list(prompts), self._encode_uncached)

    def __getattr__(self, name: str):
        if name in CachedTextPolicy._OWN:  # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.wrapped, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._OWN:
            raise AttributeError(f"cannot delete {name!r} of a CachedTextPolicy")
        delattr(self.wrapped, name)

    def __repr__(self) -> str:
        return f"CachedTextPolicy({self.wrapped!r}, {len(self.text_embedding_cache)} prompts cached)"


def _config_fingerprint(model_cfg) -> str:
    """:func:`model_fingerprint` of a ``ModelConfig``."""
    return model_fingerprint({"pipeline": model_cfg.pipeline, "path": model_cfg.path,
                              "guidance_scale": model_cfg.guidance_scale, "options": model_cfg.options})


def text_cache_covers(model_cfg, prompts: list[str]) -> bool:
    """Whether the text encoders would never run: ``model.drop_text_encoders`` with a
    ``model.text_embedding_cache`` directory that already holds every prompt of ``prompts`` (the
    trainer then does not load them at all)."""
    where = model_cfg.text_embedding_cache
    if not where or where == "memory" or not model_cfg.drop_text_encoders:
        return False
    fp = _config_fingerprint(model_cfg)
    d = cache_directory(where, fp)
    if not (d / INDEX).is_file():
        return False
    try:
        cache = TextEmbeddingCache.load(str(d), fp)
    except TextCacheError:
        return False
    return all(p in cache for p in dict.fromkeys(item_texts(prompts)))


def attach_text_cache(policy, model_cfg, prompts: list[str], is_main: bool = True,
                      barrier: Optional[Callable[[], None]] = None, progress: bool = False):
    """Apply ``model.text_embedding_cache`` / ``model.drop_text_encoders`` to a freshly loaded policy.

    ``"memory"``: every process encodes ``prompts`` once into RAM. A directory: the main process
    builds (or extends) the model setting's cache there (:func:`cache_directory`), the others wait at
    ``barrier`` and then read it. Returns the policy to
    use: a :class:`CachedTextPolicy` around ``policy`` (its ``text_embedding_cache`` is the cache),
    or ``policy`` itself when no cache is configured.
    """
    where = model_cfg.text_embedding_cache
    if not where:
        return policy
    prompts = list(dict.fromkeys(item_texts(prompts)))  # edit items: the text part only (sources are not cached)
    fp = _config_fingerprint(model_cfg)
    if where == "memory":
        cache = TextEmbeddingCache.build(policy, prompts, fp, progress=progress)
    else:
        where = cache_directory(where, fp)
        cache = TextEmbeddingCache.open_or_build(policy, prompts, where, fp, progress=progress) if is_main else None
        if barrier is not None:
            barrier()
        if cache is None:  # the other processes read what the main one wrote
            cache = TextEmbeddingCache.load(where, fp)
    cached = cache.wrap(policy, drop_encoders=model_cfg.drop_text_encoders)
    if progress and cached.freed_parameters:
        print(f"text encoders dropped: {cached.freed_parameters / 1e6:.1f}M parameters freed; "
              f"{len(cache)} prompts cached")
    return cached
