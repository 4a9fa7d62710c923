"""Activation memory of the recipe's transformer and VAE, measured on meta tensors of the real shapes.

Each pass runs the real diffusers forward (and backward) on meta inputs under
:class:`flowrl.plan.tracker.LiveBytes`, called as the pipeline's adapter calls it (its
``transformer_inputs``, on its ``geometry`` and ``example_conditioning``); what is reported is the pass's peak of live bytes above
the weights, gradients and optimizer states that exist before it (the transient and the saved
activations, the output included). Passes:

* ``train``: a differentiable forward + backward of ``rows`` rows (gradient buffers of the trained
  parameters allocated beforehand, as in every minibatch after the first), with or without
  diffusers' gradient checkpointing (``enable_gradient_checkpointing``: only block inputs are
  saved, one block's activations are recomputed during backward);
* ``infer``: a ``no_grad`` forward of ``rows`` rows (a rollout's velocity call);
* ``decode``: a ``no_grad`` VAE decode of ``rows`` latents.

Memory is affine in the rows (per-sample activations plus a constant) and in the block count of each block
type (the adapter's ``block_counts``), so each pass is measured on reduced-depth copies of the transformer (:func:`probe_depths`) at 1
and 2 rows and evaluated at any count (:meth:`Activations.bytes`); fits are cached per pass.

Context parallelism (``train.context_parallel: C``): the transformer passes are measured as one rank of
a ``C``-way group runs them, with the model's own ``_cp_plan`` applied on the meta model
(:func:`flowrl.distributed.context.emulate_context_parallel`: inputs sliced to ``1/C`` of their tokens
where the plan splits them, outputs gathered back to the whole sequence, attention over the local
tokens, which holds the same bytes as Ulysses' all heads of ``1/C`` of the tokens -> ``1/C`` of the heads
of all tokens). :meth:`Activations.degree` is that view; the VAE decode is not split.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..pipelines.facts import Geometry
from ..distributed.context import emulate_context_parallel
from .models import MetaComponents
from .tracker import LiveBytes, flash_attention


def recipe_geometry(cfg, adapter: type, configs) -> Geometry:
    """The adapter's :class:`~flowrl.pipelines.facts.Geometry` under ``model.options``; an option the recipe
    leaves unset (``resolution``, Wan's ``num_frames``) is the local model's ``flowrl.json`` entry, else the
    adapter's default."""
    from ..pipelines.base import read_flowrl_json
    from ..errors import ConfigError

    options = dict(cfg.model.options)
    if cfg.model.path:  # the local model's saved defaults (resolution, video frames) fill the unset options
        for k, v in read_flowrl_json(cfg.model.path).items():
            if options.get(k) is None:
                options[k] = v
    try:
        return adapter.geometry(configs, options)
    except (ValueError, NotImplementedError) as e:
        raise ConfigError(f"model.options: {e}") from None


def transformer_inputs(comp: MetaComponents, geometry: Geometry, rows: int, device="meta") -> tuple:
    """``(x, kwargs)``: empty latents ``x`` of ``rows`` rows and the keyword arguments of the transformer's
    forward for them, built by the adapter's own ``transformer_inputs`` (what its velocity passes)."""
    dt = comp.dtypes["transformer"]
    x = torch.empty(rows, *geometry.latent_shape, device=device, dtype=dt)  # [B, C, (F,) h, w]
    sigma = torch.empty(rows, device=device, dtype=torch.float32)  # [B]
    cond = comp.adapter.example_conditioning(comp.configs, geometry, rows, device, dt)
    return x, comp.adapter.transformer_inputs(comp.config, dt, x, sigma, cond)


def velocity_of(comp: MetaComponents, transformer, x: torch.Tensor, kw: dict) -> torch.Tensor:
    """The forward's output as the adapter's velocity shaped like ``x`` (its ``transformer_output``: a
    list of per-sample outputs for Z-Image), as its velocity computes it."""
    return comp.adapter.transformer_output(transformer(**kw)[0], x)


def probe_depths(real: dict[str, int]) -> list[dict[str, int]]:
    """A base of one block per present type and one probe per type with two; just ``[real]`` when
    that is no smaller. Without checkpointing memory is affine in each block count; with it the
    peak is bounded from above by the saved inputs (affine) plus the largest recomputation seen
    (which needs two blocks of a type to show), see :meth:`Activations._probe`."""
    base = {k: min(v, 1) for k, v in real.items()}
    probes = [{**base, k: 2} for k, v in real.items() if v > 1]
    if sum(real.values()) <= sum(sum(d.values()) for d in [base] + probes):
        return [real]
    return [base] + probes


def extrapolate(real: dict[str, int], depths: list[dict[str, int]], values: list[float]) -> float:
    """The affine function of the block counts through ``values`` at ``depths`` (probe_depths order), at ``real``."""
    if len(depths) == 1:
        return values[0]
    out, base = values[0], depths[0]
    for d, v in zip(depths[1:], values[1:]):
        k = next(k for k in d if d[k] != base[k])
        out += (v - values[0]) * (real[k] - base[k])
    return out


def checkpointed_peak(real: dict[str, int], depths: list[dict[str, int]], results: list[tuple[float, float]]) -> float:
    """Peak of a checkpointed train pass at depth ``real`` from the probes' ``(peak, saved)``.

    Backward recomputes one block at a time while the inputs of the blocks before it are still held,
    so the peak is ``max_t (K_t + R_t)``: over block types ``t`` (in forward order, the keys of
    the adapter's ``block_counts``), ``R_t`` the saved inputs of all blocks up to the last of type ``t`` and ``K_t``
    what that block's recomputation adds. Each probe bounds ``K_t <= peak - R_t``; the smallest
    bound per type, at the real depth, is an upper bound of the peak (SD3.5-M: equal to a
    full-depth meta measurement; FLUX.1-dev: 7% above it)."""
    types = list(real)
    per_block = {t: 0.0 for t in types}
    for d, (_, saved) in zip(depths[1:], results[1:]):
        t = next(k for k in d if d[k] != depths[0][k])
        per_block[t] = (saved - results[0][1]) / (d[t] - depths[0][t])

    def held(t: str, d: dict[str, int]) -> float:
        return sum(d[u] * per_block[u] for u in types[: types.index(t) + 1])

    return max(min(p - held(t, d) for d, (p, _) in zip(depths, results)) + held(t, real)
               for t in types if real[t] > 0)


def _train_pass(comp: MetaComponents, shapes: Geometry, rows: int, checkpointing: bool) -> tuple[int, int]:
    tr = comp.transformer
    tr.train()
    if checkpointing:
        tr.enable_gradient_checkpointing()
    else:
        tr.disable_gradient_checkpointing()
    for p in tr.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)  # steady state: gradients accumulate in place
    x, kw = transformer_inputs(comp, shapes, rows)
    with flash_attention(), LiveBytes().tracking() as live:
        out = velocity_of(comp, tr, x, kw)
        out.float().square().mean().backward()
        del out
    tr.disable_gradient_checkpointing()
    return live.peak, live.saved_bytes


def _infer_pass(comp: MetaComponents, shapes: Geometry, rows: int) -> tuple[int, int]:
    comp.transformer.eval()
    x, kw = transformer_inputs(comp, shapes, rows)
    with torch.no_grad(), flash_attention(), LiveBytes().tracking() as live:
        out = velocity_of(comp, comp.transformer, x, kw)
        del out
    return live.peak, 0


def _decode_pass(comp: MetaComponents, shapes: Geometry, rows: int) -> tuple[int, int]:
    if comp.vae is None:  # decoded without a VAE (pixel space): a cast and a clamp
        return 0, 0
    z = torch.empty(rows, *shapes.latent_shape, device="meta", dtype=comp.dtypes["vae"])  # [B, C, (F,) h, w]
    z = comp.adapter.vae_latents(z)  # as the adapter's decode passes them
    with torch.no_grad(), flash_attention(), LiveBytes().tracking() as live:
        img = comp.vae.decode(z, return_dict=False)[0]  # [B, 3, (F,) H, W]
        img = (img.float() / 2 + 0.5).clamp(0, 1)
        del img
    return live.peak, 0


@dataclass
class Activations:
    """Affine fits ``a + b rows`` of each pass's peak bytes (module doc), measured lazily."""

    comp: MetaComponents
    shapes: Geometry
    _fits: dict = field(default_factory=dict)
    _models: list = field(default_factory=list)  # probe depths built so far
    _built: list = field(default_factory=list)  # their meta transformers
    cp: int = 1  # context-parallel degree of this view (:meth:`degree`)

    def degree(self, cp: int) -> "Activations":
        """The same measurements as one rank of a ``cp``-way context-parallel group makes them (sharing the
        fits and meta models of this object)."""
        view = dataclasses.replace(self, cp=int(cp))
        view._fits, view._models, view._built = self._fits, self._models, self._built
        return view

    def _probe(self, kind: str, ckpt: bool, rows: int) -> tuple[float, float]:
        """(peak, saved) bytes of pass ``kind`` at ``rows``, from reduced-depth transformers (probe_depths)."""
        if kind == "decode":
            return _decode_pass(self.comp, self.shapes, rows)
        adapter = self.comp.adapter
        real = adapter.block_counts(self.comp.config)
        depths = probe_depths(real)
        results = []
        for d in depths:
            if d not in self._models:
                self._models.append(d)
                self._built.append(self.comp.transformer if d == real else
                                   self.comp.build(adapter.with_block_counts(self.comp.config, d)))
            built = self._built[self._models.index(d)]
            emulate_context_parallel(built, self.cp)
            view = dataclasses.replace(self.comp, transformer=built)
            results.append(_train_pass(view, self.shapes, rows, ckpt) if kind == "train"
                           else _infer_pass(view, self.shapes, rows))
        peak, saved = (extrapolate(real, depths, [r[i] for r in results]) for i in (0, 1))
        if kind == "train" and ckpt and len(depths) > 1:
            peak = checkpointed_peak(real, depths, results)
        return peak, saved

    def _fit(self, key: tuple) -> tuple[float, float, float, float]:
        key = (*key, self.cp if key[0] != "decode" else 1)
        if key not in self._fits:
            kind, ckpt, _ = key
            (p1, s1), (p2, s2) = self._probe(kind, ckpt, 1), self._probe(kind, ckpt, 2)
            self._fits[key] = (p1 - (p2 - p1), p2 - p1, s1 - (s2 - s1), s2 - s1)
        return self._fits[key]

    def bytes(self, kind: str, rows: int, checkpointing: bool = False) -> int:
        """Peak bytes of pass ``kind`` (train / infer / decode) at ``rows`` rows (0 rows: 0)."""
        if rows <= 0:
            return 0
        a, b, _, _ = self._fit((kind, bool(checkpointing) if kind == "train" else False))
        return int(round(a + b * rows))

    def saved(self, rows: int, checkpointing: bool = False) -> int:
        """Bytes autograd saves for backward in a train pass of ``rows`` rows (each storage once)."""
        _, _, a, b = self._fit(("train", bool(checkpointing)))
        return int(round(a + b * rows))


def max_rows(total: int, max_batch: Optional[int]) -> int:
    """Rows of the largest velocity call when ``total`` rows are chunked by ``max_batch`` (None = all)."""
    return total if not max_batch else min(total, int(max_batch))
