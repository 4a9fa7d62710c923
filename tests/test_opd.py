"""On-policy distillation (``train.loss: opd``): the closed-form step KL, its teachers' options refused in one line
when the recipe loads, the teachers declared and planned as frozen models, a teacher from a run directory, exact
resume with a LoRA export, and the digits recipe (teacher: the base at guidance 3.0; student: guidance 1.0)
raising the student's guidance-1.0 evaluation reward with no reward in its loss."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_train_overrides
from flowrl.checkpoints.common import list_checkpoints
from flowrl.errors import ConfigError
from flowrl.losses.opd import opd_kl
from flowrl.sde import sde_step
from flowrl.trainers.config import load_config
from flowrl.trainers.online import train


def _cfg(model_dir, teachers="[{source: '', guidance: 3.0}]", **extra):
    return load_config("digits_opd", tiny_train_overrides(model_dir, **{
        "train.loss_options": f"{{teachers: {teachers}}}", "train.lr": 1e-2, **extra}))


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line]


def _weights(run, group="trainable"):
    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / f"{group}.safetensors"))


def test_the_loss_is_the_closed_form_kl_of_the_two_gaussian_steps():
    g = torch.Generator().manual_seed(0)
    x, v_s, v_t, v_u = (torch.randn(3, 1, 4, 4, generator=g) for _ in range(4))
    sig, nxt = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.6, 0.3, 0.1])
    s = sde_step(v_s, x, sig, nxt, noise_level=0.7, prev_sample=x)
    t = sde_step(v_t, x, sig, nxt, noise_level=0.7, prev_sample=x)
    u = sde_step(v_u, x, sig, nxt, noise_level=0.7, prev_sample=x)
    assert torch.allclose(s.std, t.std)  # one scale: the KL is the mean gap over 2 s^2
    kl, per = opd_kl(s.mean, [t.mean], [1.0], s.std)
    want = ((s.mean - t.mean) ** 2).flatten(1).mean(1) / (2 * s.std**2)
    assert torch.allclose(kl, want) and torch.allclose(per[0], want)
    both, per2 = opd_kl(s.mean, [t.mean, u.mean], [3.0, 1.0], s.std)
    assert torch.allclose(both, 0.75 * per2[0] + 0.25 * per2[1])
    assert torch.equal(opd_kl(s.mean, [s.mean], [1.0], s.std)[0], torch.zeros(3))
    ode, _ = opd_kl(s.mean, [t.mean], [1.0], torch.zeros(3))  # a deterministic step: the mean gap over 2
    assert torch.allclose(ode, ((s.mean - t.mean) ** 2).flatten(1).mean(1) / 2)
    routed, _ = opd_kl(s.mean, [t.mean, u.mean], torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]), s.std)
    assert torch.allclose(routed, torch.stack([per2[0, 0], per2[1, 1], torch.tensor(0.0)]))  # one teacher each, none


def test_each_teacher_supervises_the_prompts_it_matches():
    from types import SimpleNamespace

    from flowrl.updates.opd import OPDOptions, OPDUpdate

    opts = OPDOptions(teachers=[{"source": "", "prompts": "digit [0-4]"}, {"source": "", "weight": 3.0,
                                                                          "prompts": "digit [4-9]"}])
    rollout = SimpleNamespace(prompts=["a handwritten digit 1", "a handwritten digit 4", "a cat"],
                              transitions=SimpleNamespace(prompt_index=torch.tensor([0, 0, 1, 2, 1])))
    w = OPDUpdate(None, opts).teacher_weights(rollout)
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 3.0, 0.0, 3.0]]))


@pytest.mark.parametrize("teachers, key", [
    ("[]", "teachers must be a non-empty list"),
    ("[{source: '', guidanse: 3.0}]", "teachers[0].guidanse: not a teacher option"),
    ("[{source: '', guidance: 0.5}]", "teachers[0].guidance must be a number >= 1.0"),
    ("[{source: ''}, {source: '', weight: 0}]", "teachers[1].weight must be a number > 0"),
    ("[{source: '', offload: maybe}]", "teachers[0].offload must be true or false"),
    ("[{source: 3}]", "teachers[0].source must be a string"),
    ("[{source: '', prompts: 'digit [0-'}]", "teachers[0].prompts must be a regular expression"),
])
def test_bad_teachers_are_refused_in_one_line_when_the_recipe_loads(teachers, key):
    with pytest.raises(ConfigError) as e:
        load_config("digits_opd", [f"train.loss_options={{teachers: {teachers}}}"])
    assert key in str(e.value) and "\n" not in str(e.value)


def test_a_sampler_without_transitions_and_a_teacher_of_another_model_are_refused(tiny_digits_dir, tmp_path):
    with pytest.raises(ConfigError, match="stores no stochastic transitions"):
        load_config("digits_opd", ["sampler={name: ode, group_size: 8, num_steps: 10}"])
    from flowrl.trainers.frozen import frozen_model_config

    with pytest.raises(ConfigError, match="is a sd3 model"):
        frozen_model_config(load_config("digits_opd"), "sd3_group_pickscore")


def test_the_teachers_are_declared_and_planned_as_frozen_models():
    from flowrl.plan.core import plan_memory

    cfg = load_config("digits_opd", ["train.loss_options={teachers: [{source: '', guidance: 3.0}, "
                                     "{source: digits, weight: 0.5, offload: true}]}"])
    assert cfg.train.update_needs.frozen_models == (("", 3.0, False), ("digits", None, True))
    assert not cfg.train.update_needs.reference and not cfg.train.update_needs.reward_in_loss
    from flowrl.eval.models import ModelSpec, trained_rewards

    run = ModelSpec("run", "runs/x", "x")  # flowrl eval's hacking verdict: the digits reward was never trained on
    assert trained_rewards(run, cfg) == [] and trained_rewards(run, load_config("digits")) == ["digits"]
    items = {i.name: i for i in plan_memory(cfg).items}
    t0 = items["frozen model 0 (the base model, guidance 3): transformer (float32)"]
    t1 = items["frozen model 1 (digits, guidance 1): transformer (float32)"]
    assert t0.bytes == t1.bytes > 0 and (t0.where, t1.where) == ("gpu", "host")
    assert "frozen model 1 (digits, guidance 1): transformer on the GPU for its forward" in items
    assert items["frozen model 0 (the base model, guidance 3): step means at the stored transitions "
                 "(80 x 10 steps, float32)"].bytes == 80 * 10 * 256 * 4


def test_distils_a_run_directory_teacher_resumes_exactly_and_exports(tiny_digits_dir, tmp_path):
    """A teacher equal to the student (the base at the student's guidance) gives a zero KL; a trained run directory
    as the teacher a positive one that training lowers; an OPD run (with train.ema) resumes to the same weights and
    EMA, and exports its LoRA."""
    same = tmp_path / "same"
    train(_cfg(tiny_digits_dir, "[{source: '', guidance: 1.0}]", **{"train.iterations": 1}), same)
    (rec,) = _records(same)
    assert rec["opd_kl"] == 0.0 and rec["transitions_trained"] == 64
    none = tmp_path / "none"  # a teacher of no prompt drawn: nothing to train, no step, no error
    train(_cfg(tiny_digits_dir, "[{source: '', prompts: 'no such prompt'}]", **{"train.iterations": 1}), none)
    (rec,) = _records(none)
    assert rec["opd_unsupervised_fraction"] == 1.0 and rec["transitions_trained"] == 0
    teacher = tmp_path / "teacher"  # an OPD run itself: distilled from the base at guidance 3.0
    train(_cfg(tiny_digits_dir, **{"train.iterations": 2}), teacher)
    assert all(r["opd_kl"] > 0 and r["skipped_steps"] == 0 for r in _records(teacher))
    full, part = tmp_path / "full", tmp_path / "part"
    src = f"[{{source: '{teacher}', weight: 2.0}}, {{source: '', guidance: 2.0, offload: true}}]"
    ema = {"train.ema": "true"}
    train(_cfg(tiny_digits_dir, src, **{"train.iterations": 3}, **ema), full)
    recs = _records(full)
    assert all(r["opd_kl/teacher0"] > 0 and r["opd_kl/teacher1"] > 0 for r in recs)
    assert recs[-1]["opd_kl/teacher0"] < recs[0]["opd_kl/teacher0"]
    train(_cfg(tiny_digits_dir, src, **{"train.iterations": 1}, **ema), part)
    train(_cfg(tiny_digits_dir, src, **{"train.iterations": 3}, **ema), part, resume=True)
    w, w2 = _weights(full), _weights(part)
    assert all(torch.equal(w[k], w2[k]) for k in w) and any(v.abs().sum() > 0 for k, v in w.items() if "lora_B" in k)
    e, e2 = (_weights(r, "ema") for r in (full, part))
    assert e.keys() == w.keys() and all(torch.equal(e[k], e2[k]) for k in e)
    assert any(not torch.equal(e[k], w[k]) for k in e)  # the EMA lags behind the weights
    from flowrl.export import export_run

    export_run(full, tmp_path / "export", model_path=str(tiny_digits_dir))
    assert (tmp_path / "export" / "pytorch_lora_weights.safetensors").is_file()


def test_the_digits_recipe_brings_the_student_toward_the_guided_teacher(pretrained_digits_base, tmp_path):
    """The student (guidance 1.0, ~0.87) distilled from the base at guidance 3.0 (~0.99) on the training
    evaluation's prompts and seeds: in 4 iterations its guidance-1.0 evaluation reward covers most of the gap to
    the teacher's; the rollout's reward is never in the loss."""
    from flowrl.builders import build_policy_from_config, build_reward, evaluate_policy

    cfg = load_config("recipes/digits_opd.yaml", [
        "train.iterations=4", "logging.trackers=[]", "logging.progress=false", "logging.eval_every=4",
        "reward.heldout={}", "train.checkpoint_every=100"])
    teacher = build_policy_from_config(load_config("digits_opd", ["model.guidance_scale=3.0"]), "cpu")
    met, _ = evaluate_policy(teacher, build_reward(cfg), {}, cfg.data.eval_prompt_set(),
                             cfg.data.eval_seeds_per_prompt, cfg.sampler.options["num_steps"], 0)
    summary = train(cfg, tmp_path / "run")
    before, after, goal = summary["eval_reward_before"], summary["eval_reward_after"], met["eval/reward"]
    assert goal > before + 0.05 and after > before + 0.7 * (goal - before), (before, after, goal)
    assert summary["skipped_steps"] == 0


def test_an_opd_run_is_the_model_path_of_a_later_rl_run(tiny_digits_dir, tmp_path):
    """model.path a run directory: its base with the run's newest LoRA fused in; the later run (GRPO) adds its own
    LoRA on top, starts from the OPD run's policy, plans from the base's configs and exports with a note."""
    from flowrl.builders import build_policy_from_config
    from flowrl.export import export_run
    from flowrl.plan.core import plan_memory
    from flowrl.sampling_cli import load_policy

    opd = tmp_path / "opd"
    train(_cfg(tiny_digits_dir, **{"train.iterations": 1}), opd)
    rl_cfg = load_config("digits", tiny_train_overrides(opd, **{"train.iterations": 1}))
    _, trained = load_policy(None, str(opd), ["model.device=cpu"])  # the OPD run: base + its LoRA
    start = build_policy_from_config(rl_cfg, "cpu")  # the later run's model before its own LoRA
    assert not any("lora" in n for n, _ in start.transformer.named_parameters())
    x, sig = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(0)), torch.full((4,), 0.6)
    base = build_policy_from_config(load_config("digits", [f"model.path={tiny_digits_dir}"]), "cpu")
    with torch.no_grad():
        a, b, c = (p.velocity(x, sig, p.encode_prompts(["a 1", "a 2", "a 3", "a 4"])) for p in (trained, start, base))
    assert torch.allclose(a, b, atol=1e-5) and not torch.allclose(a, c, atol=1e-3)  # the run's, not the base's
    rl = tmp_path / "rl"
    summary = train(rl_cfg, rl)
    assert summary["skipped_steps"] == 0 and _weights(rl)
    assert any(i.name.startswith("transformer weights") and i.bytes > 0 for i in plan_memory(rl_cfg).items)
    info = export_run(rl, tmp_path / "export")
    assert info["base_model"] == str(tiny_digits_dir) and str(opd) in info["note"]


def test_a_loop_of_runs_is_one_error_for_every_reader(tmp_path):
    """Two runs naming each other as model.path: plan / export (base_model_path) and the builder (run_chain) stop
    with one ConfigError instead of following them forever."""
    from flowrl.checkpoints.runs import base_model_path, run_chain
    from flowrl.errors import ConfigError

    a, b = tmp_path / "a", tmp_path / "b"
    for run, other in ((a, b), (b, a)):
        (run / "checkpoints" / "iter_000001").mkdir(parents=True)
        (run / "config.yaml").write_text(f"model: {{pipeline: digits, path: {other}}}\n")
    for read in (base_model_path, run_chain):
        with pytest.raises(ConfigError, match="form a loop"):
            read(str(a))
