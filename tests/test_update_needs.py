"""Updates own their options and declare what they need (flowrl.updates.base); config validation refuses a
combination an update cannot run when the recipe is loaded, before any model loads, in one line with the fix."""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from flowrl.errors import ConfigError
from flowrl.trainers.config import load_config
from flowrl.updates import UPDATES, default_needs, updates_by_input

ROOT = Path(__file__).resolve().parents[1]
ODE = "sampler={name: ode, group_size: 8, num_steps: 4}"
SOL_ODE = "sampler={name: sol, explore_backend: none, pool_size: 8, keep: 4, preview_steps: 2, regen: ode}"

# (recipe, overrides, what the one-line error must say)
IMPOSSIBLE = {
    "grpo_guard on an ODE sampler": (
        "digits", ["train.loss=grpo_guard", ODE],
        "'ode' sampler (as configured) stores no stochastic transitions, so train.loss=grpo_guard would have nothing"),
    "grpo on an ODE sampler": ("digits", [ODE], "stores no stochastic transitions, so train.loss=grpo"),
    "grpo on Sol regenerating by ODE": ("digits", [SOL_ODE], "'sol' sampler (as configured) stores no stochastic"),
    "grpo_guard on Sol regenerating by ODE": ("digits", ["train.loss=grpo_guard", SOL_ODE],
                                              "train.loss=grpo_guard would have nothing to train on"),
    "an online loss in offline mode": ("digits_gdro", ["train.loss=grpo", "train.loss_options={}"],
                                       "train.mode=offline trains on a dataset, and train.loss=grpo trains on rollouts: "
                                       "use train.loss=offline_gdro"),
    "DiffusionNFT in offline mode": ("digits_gdro", ["train.loss=nft", "train.loss_options={}"],
                                     "train.loss=nft trains on rollouts"),
    "online GDRO in offline mode": ("digits_gdro", ["train.loss=gdro", "train.loss_options={}"],
                                    "train.loss=gdro trains on rollouts"),
    "the offline loss online": ("digits", ["train.loss=offline_gdro", "train.loss_options={}"],
                                "train.loss=offline_gdro trains on a dataset from `flowrl generate-offline`: set "
                                "train.mode=offline"),
    "a KL weight for DPO (no KL term)": ("digits", ["train.loss=dpo", "train.loss_options={beta_kl: 0.04}", ODE],
                                         "train.loss_options.beta_kl: not an option of train.loss='dpo'"),
    "a KL weight for online GDRO": ("digits", ["train.loss=gdro", "train.loss_options={beta_kl: 0.04}", ODE],
                                    "train.loss_options.beta_kl: not an option of train.loss='gdro'"),
    "a KL weight for offline GDRO": ("digits_gdro", ["train.loss_options.beta_kl=0.1"],
                                     "train.loss_options.beta_kl: not an option of train.loss='offline_gdro'"),
    "a KL form for DiffusionNFT (its KL is in velocity space)": (
        "digits_sol_nft", ["train.loss_options.kl_form=exact"], "train.loss_options.kl_form: not an option of "
        "train.loss='nft'"),
    "inner epochs in offline mode": ("digits_gdro", ["train.inner_epochs=2"],
                                     "train.inner_epochs=2 has no effect in offline mode"),
    "GRPO's options for DiffusionNFT": ("digits", ["train.loss=nft", "train.loss_options.clip_range=0.1"],
                                        "train.loss_options.clip_range: not an option of train.loss='nft'"),
    "DiffusionNFT's options for GRPO": ("digits", ["train.loss_options={beta: 2.0}"],
                                        "train.loss_options.beta: not an option of train.loss='grpo'"),
    "an advantage option the update sets": ("digits", ["train.loss_options.advantage_options={adv_clip: 10}"],
                                            "advantage_options.adv_clip: the update sets it; use train.loss_options.adv_clip_max"),
    "a negative KL weight": ("digits", ["train.loss_options.beta_kl=-1"],
                             "train.loss_options.beta_kl must be a number >= 0, got -1"),
    "a zero advantage clip": ("digits_sol_nft", ["train.loss_options.adv_clip_max=0"],
                              "train.loss_options.adv_clip_max must be a number > 0, got 0"),
    "FSDP with fp16": ("digits", ["train.sharding=fsdp", "train.mixed_precision=fp16"],
                       "train.sharding=fsdp supports train.mixed_precision 'no' or 'bf16'"),
    "CPU offload without FSDP": ("digits", ["train.cpu_offload=true"], "train.cpu_offload=true needs train.sharding=fsdp"),
    "LoRA targets on a full fine-tune": ("digits", ["train.lora_rank=0", "train.lora_targets=[to_q]"],
                                         "train.lora_targets names LoRA targets, but train.lora_rank=0"),
    "options of a reward not trained on": ("digits", ["reward.options={jpeg_compressibility: {}}"],
                                           "reward.options.jpeg_compressibility: 'jpeg_compressibility' is not in "
                                           "reward.weights"),
    "text encoders dropped without a cache": ("digits", ["model.drop_text_encoders=true"],
                                              "model.drop_text_encoders=true needs model.text_embedding_cache"),
    "a batch that does not split into groups": ("digits", ["train.batch_size=81"],
                                                "not a multiple of the sampler's 8 samples per prompt"),
    "dppo on an ODE sampler": ("digits_dppo", [ODE], "stores no stochastic transitions, so train.loss=dppo would have"),
    "a zero trust region": ("digits_dppo", ["train.loss_options.kl_threshold=0"],
                            "train.loss_options.kl_threshold must be a number > 0, got 0"),
    "GARDO's auxiliary reward not scored": (
        "digits_gardo", ["reward.weights={digits: 1.0}"], "train.loss=gardo_grpo reads reward 'jpeg_compressibility' of "
        "every rollout, which reward.weights does not score; add it there with weight 0"),
    "GARDO on GRPO over a tree": (
        "digits_gardo", ["sampler={name: branch, num_steps: 3, split_steps: [0, 1], window: 2}"],
        "train.loss=gardo_grpo trains on flat groups (each stored transition leads to one finished sample), and the "
        "'branch' sampler branches into trees"),
    "GARDO on GRPO over TempFlow's branches": (
        "digits_gardo", ["sampler={name: tempflow, num_steps: 3, branch_steps: [0, 1]}"],
        "'tempflow' sampler branches into trees; use sampler.name=group (or sol with regen: group), or train.loss="),
    "GARDO with an unknown feature model": ("digits_gardo", ["train.loss_options.features=clip"],
                                            "train.loss_options.features: unknown feature model 'clip'"),
    "GARDO's DINO features without a model": ("digits_gardo", ["train.loss_options.features=dino"],
                                              "the 'dino' feature model needs train.loss_options.features_options.path"),
    "GARDO's DINO features from a missing directory": (
        "digits_gardo", ["train.loss_options.features=dino", "train.loss_options.features_options={path: /no/dino}"],
        "train.loss_options.features_options.path=/no/dino: no such directory"),
    "GARDO's gate bounds reversed": ("digits_gardo", ["train.loss_options.gate_bounds=[0.2, 0.1]"],
                                     "train.loss_options.gate_bounds must be [low, high]"),
    "a moved key: DiffusionNFT's beta": ("digits_sol_nft", ["train.nft_beta=2.0"],
                                         "unknown key train.nft_beta. It is an option of the update now: "
                                         "train.loss_options.beta (train.loss: nft / gardo_nft)"),
    "a moved key: GDRO's beta": ("digits_gdro", ["offline.beta=3.0"],
                                 "unknown key offline.beta. It is an option of the update now: train.loss_options.beta "
                                 "(train.loss: offline_gdro)"),
    "a moved key: the clip range": ("digits", ["train.clip_range=0.2"],
                                    "train.loss_options.clip_range (train.loss: grpo / grpo_guard / gardo_grpo)"),
    "a moved key: the KL weight": ("digits", ["train.beta_kl=0.1"], "unknown key train.beta_kl. It is an option of "
                                   "the update now: train.loss_options.beta_kl (train.loss: grpo / grpo_guard / dppo / "
                                   "gardo_grpo / nft / gardo_nft)"),
    "a moved key: the KL form": ("digits", ["train.kl_form=exact"],
                                 "train.loss_options.kl_form (train.loss: grpo / grpo_guard / dppo / gardo_grpo)"),
    "a moved key: the advantage clip": ("digits", ["train.adv_clip_max=3"],
                                        "train.loss_options.adv_clip_max (train.loss: grpo / grpo_guard / dppo / "
                                        "gardo_grpo / nft / gardo_nft)"),
    "a moved key: the CFG gradient": ("digits_gdro", ["train.cfg_uncond_grad=true"],
                                      "train.loss_options.cfg_uncond_grad (every train.loss)"),
}


@pytest.mark.parametrize("case", list(IMPOSSIBLE))
def test_impossible_combinations_fail_at_config_time(case):
    recipe, overrides, reason = IMPOSSIBLE[case]
    with pytest.raises(ConfigError) as e:
        load_config(recipe, overrides)
    msg = str(e.value)
    assert reason in msg, msg
    assert "\n" not in msg  # one line


@pytest.mark.parametrize("recipe, overrides", [
    ("digits", ["train.loss=grpo_guard"]),  # GRPO-Guard on SDE transitions, with GRPO's options
    ("digits", ["train.loss=nft", "train.loss_options={}", ODE]),  # DiffusionNFT on ODE samples, with a KL term
    ("digits", ["train.loss=dpo", "train.loss_options={}", ODE]),
    ("digits", ["train.loss=dpo", ODE]),  # the recipe's GRPO options are dropped with a notice
    ("digits", ["train.loss=gdro", "train.loss_options={beta: 6.0, tau: 0.0, cfg_uncond_grad: true}", SOL_ODE]),
    ("digits", ["reward.aggregate=per_reward"]),  # GRPO normalises each reward apart
    ("digits_gdro", ["reward.aggregate=per_reward"]),  # so does offline GDRO's ranking
    ("digits_sol_nft", ["reward.aggregate=per_reward"]),  # and every update on finished samples (tests/test_per_reward.py)
    ("digits_gdro", ["train.loss=null"]),  # no loss named: the mode's (offline_gdro)
    ("digits_gardo", ["train.loss=gardo_nft", ODE]),  # GARDO on NFT: GRPO's clip_range dropped with a notice
    ("digits_gardo", ["train.loss=gardo_nft", SOL_ODE]),  # ... on Sol regenerating by ODE
    ("digits_dppo", ["sampler={name: branch, num_steps: 4, split_steps: [0, 1], window: 2}", "train.batch_size=40"]),
    ("digits_opd", ["sampler={name: branch, num_steps: 4, split_steps: [0, 1], window: 2}", "train.batch_size=40"]),
    ("digits_opd", ["sampler.sde_window=2"]),  # OPD on the window's steps only (DanceOPD-style fewer queries)
])
def test_possible_combinations_load(recipe, overrides):
    cfg = load_config(recipe, overrides)
    assert cfg.train.loss in UPDATES


def test_every_update_declares_what_it_needs():
    by_input = {k: sorted(v) for k, v in updates_by_input().items()}  # (registry order: the suite may re-register)
    assert by_input == {"rollout": sorted(["grpo", "nft", "dpo", "gdro", "grpo_guard", "awm", "dgpo", "dppo",
                                           "gardo_grpo", "gardo_nft", "opd"]),
                        "dataset": sorted(["offline_gdro", "sft", "dpo_offline"]),
                        "samples": sorted(["nft", "dpo", "gdro", "awm", "dgpo", "gardo_nft"])}
    needs = {n: default_needs(n) for n in UPDATES.entries}
    assert {n for n, d in needs.items() if d.transitions} == {"grpo", "grpo_guard", "dppo", "gardo_grpo", "opd"}
    assert {n: d.frozen_models for n, d in needs.items() if d.frozen_models} == {"opd": (("", 3.0, False),)}
    assert {n for n, d in needs.items() if d.clean_samples} == {"nft", "dpo", "gdro", "awm", "dgpo", "gardo_nft"}
    assert {n: d.copies for n, d in needs.items() if d.copies} == {  # GARDO's adaptive reference (KL on by default)
        "nft": ("old_policy",), "dgpo": ("old_policy",), "gardo_grpo": ("gardo_reference",),
        "gardo_nft": ("old_policy", "gardo_reference")}
    assert {n: d.unit for n, d in needs.items()} == {"grpo": "transition", "grpo_guard": "transition", "nft": "sample",
                                                     "dpo": "pair", "gdro": "group", "offline_gdro": "group",
                                                     "awm": "sample", "dgpo": "group", "dppo": "transition",
                                                     "gardo_grpo": "transition", "gardo_nft": "sample",
                                                     "opd": "transition", "sft": "sample", "dpo_offline": "pair"}
    refs = {}
    for n in UPDATES.entries:  # the reference follows the KL weight where the update has one
        cls = UPDATES.get(n)
        on = {"beta_kl": 0.04} if "beta_kl" in {f.name for f in dataclasses.fields(cls.Options)} else {}
        refs[n] = (cls.needs(cls.Options(**on)).reference, cls.needs(cls.Options()).reference)
    assert refs == {"grpo": (True, False), "grpo_guard": (True, False), "nft": (True, False), "dpo": (True, True),
                    "gdro": (True, True), "offline_gdro": (True, True), "awm": (True, False), "dgpo": (True, True),
                    "dppo": (True, False), "opd": (False, False),  # OPD: frozen teachers (frozen_models), no reference
                    "gardo_grpo": (False, False), "gardo_nft": (False, False),  # GARDO: its own copy, not the frozen one
                    "sft": (False, False), "dpo_offline": (True, True)}  # SFT: no reference; offline DPO: the base
    assert {n for n, d in needs.items() if d.reference_in_graph} == {"dpo", "gdro", "offline_gdro",
                                                                     "dpo_offline"}  # (KL off)
    assert {n: d.data for n, d in needs.items() if d.consumes == "dataset"} == {
        "offline_gdro": "groups", "sft": "images", "dpo_offline": "pairs"}


def test_options_are_built_once_typed_and_kept(monkeypatch):
    """The update's options are built when the config loads (validated before any model) and kept on it."""
    import flowrl.trainers.config as config

    cfg = load_config("digits")
    opts = cfg.train.update_options
    assert type(opts).__name__ == "GRPOOptions" and (opts.beta_kl, opts.kl_form, opts.clip_range) == (0.04, "exact", 1e-3)
    assert cfg.train.update_needs.reference and cfg.effective_loss_options()["kl_form"] == "exact"
    monkeypatch.setattr(config, "build_options", lambda *a, **k: pytest.fail("the options were built again"))
    assert cfg.effective_loss_options()["beta_kl"] == 0.04 and cfg.train.update_options is opts


def test_each_gdro_beta_is_set_one_way():
    online = load_config("digits", ["train.loss=gdro", "train.loss_options={beta: 3.0}", ODE])
    offline = load_config("digits_gdro", ["train.loss_options.beta=3.0"])
    assert online.effective_loss_options()["beta"] == 3.0 and offline.effective_loss_options()["beta"] == 3.0
    assert not hasattr(online.train, "pref_beta") and not hasattr(offline.offline, "beta")


def test_the_mode_picks_the_default_loss():
    assert load_config("digits").train.loss == "grpo"
    assert load_config("digits_gdro", ["train.loss=null"]).train.loss == "offline_gdro"


def test_prompts_per_iteration_builds_no_sampler(monkeypatch):
    cfg = load_config("digits")
    monkeypatch.setattr(type(cfg.sampler), "build", lambda self: pytest.fail("a sampler was built again"))
    assert cfg.prompts_per_iteration == 10 and cfg.sampler.samples_per_prompt == 8


# ---------------------------------------------------------------- nothing else reads an update's name
SEAM = ("flowrl/updates/", "flowrl/losses/")  # the only places that may name a method


def _strings(node) -> set:
    """String constants of ``node``: itself, or the items of a tuple / list / set literal."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def _names_loss(node) -> bool:
    """``x.loss``, ``loss``, ``x["loss"]`` or ``x.get("loss")``: an expression that reads a loss name."""
    if isinstance(node, ast.Attribute):
        return node.attr == "loss"
    if isinstance(node, ast.Name):
        return node.id == "loss"
    if isinstance(node, ast.Subscript):
        return "loss" in _strings(node.slice)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return any("loss" in _strings(a) for a in node.args)
    return False


def loss_name_comparisons(root=None) -> list[str]:
    """``path:line`` of every comparison of a loss with a method's name (a registered update's name, or any
    string compared with ``train.loss``), and every table keyed by update names, outside :data:`SEAM`."""
    root = root or ROOT
    names = set(UPDATES.entries)
    out = []
    for pkg in ("flowrl", "pipelines", "rewards"):
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(SEAM):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    literal = set().union(*(_strings(s) for s in sides))
                    if literal & names or (literal and any(_names_loss(s) for s in sides)):
                        out.append(f"{rel}:{node.lineno}")
                elif isinstance(node, ast.Dict) and len(_strings(ast.Tuple(elts=[k for k in node.keys if k])) & names) >= 2:
                    out.append(f"{rel}:{node.lineno}")
    return out


def test_no_code_outside_the_updates_compares_a_loss_name():
    assert loss_name_comparisons() == []


def test_the_loss_name_check_finds_what_it_forbids(tmp_path):
    (tmp_path / "flowrl" / "plan").mkdir(parents=True)
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "rewards").mkdir()
    (tmp_path / "flowrl" / "plan" / "x.py").write_text(
        "a = cfg.train.loss == 'nft'\nb = cfg.train.loss in ('dpo', 'gdro')\nc = loss != 'anything'\n"
        "d = {'grpo': 1, 'nft': 2}[name]\ne = name == 'group'\nf = x.mode == 'offline'\n")
    (tmp_path / "flowrl" / "updates").mkdir()
    (tmp_path / "flowrl" / "updates" / "y.py").write_text("a = loss == 'nft'\n")  # the seam may
    assert loss_name_comparisons(tmp_path) == [f"flowrl/plan/x.py:{i}" for i in (1, 2, 3, 4)]


# ---------------------------------------------------------------- the worked example of docs/design.md
def worked_example() -> str:
    """The Python block after the ``worked-example: rwr`` marker of docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    after = text[text.index("<!-- worked-example: rwr"):]
    return after.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_the_worked_example_is_one_file_and_one_line_and_trains(tiny_digits_dir, tmp_path, monkeypatch):
    """docs/design.md's new update (reward-weighted flow matching), registered by one line, trains on ODE
    samples through the trainer's loop; validation and plan read its declarations."""
    import sys
    import types

    from conftest import tiny_train_overrides

    from flowrl.plan.budget import pass_rows
    from flowrl.trainers.online import train

    module = types.ModuleType("flowrl_docs_rwr")
    monkeypatch.setitem(sys.modules, "flowrl_docs_rwr", module)  # (dataclasses look their module up)
    exec(compile(worked_example(), "docs/design.md (rwr)", "exec"), module.__dict__)
    monkeypatch.setitem(UPDATES, "rwr", "flowrl_docs_rwr:RWRUpdate")  # the one registry line
    ov = tiny_train_overrides(tiny_digits_dir, **{"train.loss": "rwr", "train.loss_options": "{temperature: 0.5}",
                                                  "train.iterations": 2, "train.lr": 1e-2})
    cfg = load_config("digits", [o for o in ov if not o.startswith("sampler.")] + [ODE])
    assert cfg.train.update_needs.clean_samples and not cfg.train.update_needs.reference
    assert pass_rows(cfg) == cfg.train.minibatch_size  # unit: sample
    with pytest.raises(ConfigError, match="train.loss=rwr trains on rollouts"):
        load_config("digits_gdro", ["train.loss=rwr", "train.loss_options={}"])
    with pytest.raises(ConfigError, match="reward.aggregate=per_reward has no effect with train.loss=rwr"):
        load_config("digits", ["train.loss=rwr", "train.loss_options={}", "reward.aggregate=per_reward", ODE])
    summary = train(cfg, tmp_path / "run")
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if "fm_loss" in line]
    assert summary["iterations_done"] == 2 and len(recs) == 2
    assert all(r["transitions_trained"] == cfg.train.batch_size and r["grad_norm"] > 0 for r in recs)
