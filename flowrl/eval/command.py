"""``flowrl eval`` as a harness: models x suite x reward panel -> tables, ``eval.json``, ``report.html``.

1. The models (``--config`` / ``--run``, repeatable, in order) and their configs; they must share a
   pipeline. Dotted overrides apply to every model, except ``reward.options.NAME...`` for a panel
   reward, which sets that reward's options in the panel (``reward.options.geneval.detector=m:f``).
2. The suite (``--suite``, ``--prompts`` or the first model's ``data.eval_prompts``), the seeds
   (``--seed``: the same for every model), the panel (``--rewards`` or every model's trained and
   held-out rewards; options from the configs' ``reward.options`` / ``reward.heldout``, then the
   command line). A suite without source images is refused for a reward that scores edits against
   their sources (``digits_edit``: every score would be NaN) and for a model that cannot generate
   without one (Qwen-Image-Edit); an editing model that can (FLUX.1 Kontext) is evaluated text-to-image,
   with a note (:func:`flowrl.conditions.check_sources`).
3. Each model in turn: loaded, sampled and scored chunk by chunk (:mod:`flowrl.eval.panel`), freed.
4. The statistics (:mod:`flowrl.eval.results`), printed as tables; with ``--out`` also written as
   ``eval.json`` and ``report.html`` (atomically, after the last chunk). A reward that scored no prompt
   of some tag has no mean over tags: one warning line per such reward on stderr names the tags.
"""
from __future__ import annotations

import sys
from pathlib import Path

from flowrl.conditions import check_sources
from flowrl.errors import ConfigError
from flowrl.sampling_cli import SUITE_HINT
from flowrl.seeding import derive_seeds
from flowrl.utils.io import write_json, write_text

from .models import (check_same_pipeline, checkpoint_of, load_model, load_model_config, model_specs,
                     trained_rewards)
from .panel import Plan, Store, build_panel, evaluate_model, thumb_path
from .suites import SUITES, load_suite


def split_panel_overrides(overrides: list[str], panel: list[str]) -> tuple[list[str], dict]:
    """(overrides for the configs, ``{reward: {option: value}}`` for the panel) (module doc)."""
    from flowrl.trainers.config_text import parse_override

    keep, options = [], {}
    for o in overrides:
        parts, value = parse_override(o) if o.startswith("reward.options.") else ([], None)
        if len(parts) >= 4 and parts[2] in panel:
            node = options.setdefault(parts[2], {})
            for key in parts[3:-1]:
                node = node.setdefault(key, {})
            node[parts[-1]] = value
        else:
            keep.append(o)
    return keep, options


def panel_names(given: list[str], configs: list) -> list[str]:
    """The panel: ``--rewards`` as given, else every model's trained and held-out rewards."""
    from flowrl.rewards import available

    names = given or list(dict.fromkeys(n for c in configs for n in [*c.reward.weights, *c.reward.heldout]))
    unknown = [n for n in names if n not in available()]
    if unknown:
        raise ConfigError(f"--rewards: unknown reward {unknown[0]!r}; valid rewards: {', '.join(available())}")
    return names


def panel_options(names: list[str], configs: list, cli: dict) -> dict:
    """Each panel reward's options: a config's ``reward.heldout`` / ``reward.options`` entry, then ``cli``; each
    held against the reward's declaration before any reward loads (one line naming the option)."""
    from flowrl.rewards import check_options

    out = {}
    for n in names:
        opts: dict = {}
        for c in reversed(configs):  # the first model's settings win
            opts.update(c.reward.heldout.get(n) or {})
            opts.update(c.reward.options.get(n) or {})
        out[n] = {**opts, **cli.get(n, {})}
        check_options(n, out[n], f"reward.options.{n}")
    return out


def suite_of(a, cfg):
    if a.suite and a.prompts:
        raise ConfigError("give --suite or --prompts, not both")
    if a.suite or a.prompts:
        return load_suite(a.suite or list(a.prompts))
    ev = cfg.data.eval_prompts
    if isinstance(ev, str) and (ev in SUITES or Path(ev).suffix in (".jsonl", ".txt", ".csv")):
        return load_suite(ev)
    return load_suite(cfg.data.eval_prompt_set())


def _run_models(a, specs, configs, plan, cfg_overrides) -> tuple[list[dict], dict]:
    import torch

    panel = build_panel(plan.rewards)
    models, results = [], {}
    for spec, cfg0 in zip(specs, configs):
        steps = a.steps or cfg0.sampler.build().num_steps
        fingerprint = {"suite": plan.suite.fingerprint(), "per_prompt": plan.per_prompt, "seed": a.seed,
                       "prompts_per_chunk": plan.prompts_per_chunk, "steps": steps, "kind": spec.kind,
                       "path": str(Path(spec.path).resolve()), "checkpoint": checkpoint_of(spec, a.checkpoint),
                       "ema": bool(a.ema and spec.kind == "run"), "rewards": plan.rewards, "overrides": cfg_overrides}
        store = Store(Path(a.out) if a.out else None, spec.slug, fingerprint)
        cfg, policy, info = load_model(spec, cfg_overrides, a.checkpoint if spec.kind == "run" else None,
                                       a.ema and spec.kind == "run")
        print(f"[flowrl] {spec.label}: {len(plan.suite.items)} prompt(s) x {plan.per_prompt} seeds, {steps} ODE "
              f"steps, guidance {cfg.model.guidance_scale:g}", file=sys.stderr, flush=True)
        results[spec.label] = evaluate_model(policy, steps, plan, panel, store, spec.label)
        del policy
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        models.append({"label": spec.label, "kind": spec.kind, "path": spec.path, **info,
                       "pipeline": cfg.model.pipeline, "model_path": cfg.model.path, "steps": steps,
                       "guidance": cfg.model.guidance_scale, "trained": trained_rewards(spec, cfg)})
    return models, results


def eval_harness(a) -> str:
    """``flowrl eval`` with a suite, a panel, a report or several models (module doc); returns the tables."""
    from .report_html import render as render_html
    from .report_text import render as render_text
    from .results import assemble, unscored_tags

    specs = model_specs(a.models)
    named = [n.strip() for n in (a.rewards or "").split(",") if n.strip()]
    cfg_overrides, cli_options = split_panel_overrides(list(a.overrides or []), named)
    configs = [load_model_config(s, cfg_overrides) for s in specs]
    check_same_pipeline(specs, configs)
    if (a.checkpoint is not None or a.ema) and not any(s.kind == "run" for s in specs):
        raise ConfigError("--checkpoint and --ema choose a run's weights: give --run RUN_DIR with them")
    suite = suite_of(a, configs[0])
    names = panel_names(named, configs)
    setting = f"--suite {a.suite}" if a.suite else "--prompts" if a.prompts else "data.eval_prompts"
    note = check_sources(configs[0].model.pipeline, [it.prompt for it in suite.items], setting, names, SUITE_HINT,
                         other_reward="leave it out of --rewards")  # before any model loads
    if note:
        print(f"[flowrl] note: {note}", file=sys.stderr, flush=True)
    S = a.per_prompt
    plan = Plan(suite, S, derive_seeds(a.seed, len(suite.items) * S), panel_options(names, configs, cli_options),
                max(1, a.batch // S), max_batch=a.batch)
    models, results = _run_models(a, specs, configs, plan, cfg_overrides)
    result = assemble(plan, models, results, a.bootstrap, meta={"seed": a.seed, "out": a.out})
    for line in unscored_tags(result):  # a number the tables leave out, said where a script's log shows it
        print(f"[flowrl] WARNING: {line}", file=sys.stderr, flush=True)
    if a.out:
        out = Path(a.out)
        write_json(result, out / "eval.json")
        slugs = {s.label: s.slug for s in specs}
        write_text(out / "report.html", render_html(result, lambda label, p: thumb_path(out, slugs[label], p)))
    if a.json:
        write_json(result, Path(a.json))
    return render_text(result)
