"""Every registered part declares its options (flowrl/options.py): for each model adapter, reward and sampler, a
typo, a wrong type and a value out of its declared range are refused when the config loads, in one line that
names the key, before any model loads; `flowrl train` and `flowrl plan` say it as `flowrl VERB: error: ...`
(exit 2) and write nothing. The bad values are made from each part's own declaration, so a new part is held
to the same rule by this test without a row of its own."""
from __future__ import annotations

import typing

import pytest

from flowrl.errors import ConfigError
from flowrl.options import AtLeast, Between, DeviceName, OneOf, Option, URLScheme, fits
from flowrl.pipelines import REGISTRY as MODELS
from flowrl.pipelines import policy_class
from flowrl.registry import SAMPLERS
from flowrl.rewards import REGISTRY as REWARDS
from flowrl.rewards import declared_options as reward_options
from flowrl.trainers.config import ModelConfig, RewardConfig, SamplerConfig

NOT_A_SCALAR = {"a": 1}  # no scalar, list or name option takes a mapping


def _constraints(option: Option) -> list:
    """The option's constraints, those on the members of its Optional / Union / Literal included, as
    ``(constraint, base type)`` pairs; a Literal counts as a set of names."""
    out = [(c, option.type) for c in option.constraints]
    tp = option.type
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType")) \
        else (tp,)
    for a in args:
        if typing.get_origin(a) is typing.Annotated:
            base, *extra = typing.get_args(a)
            out += [(c, base) for c in extra]
        elif typing.get_origin(a) is typing.Literal:
            out.append((OneOf(typing.get_args(a)), str))
    return out


def out_of_range(option: Option):
    """A value of the option's type that breaks one of its constraints, or None where it declares none."""
    for c, base in _constraints(option):
        if isinstance(c, AtLeast):
            value = c.minimum if c.strict else c.minimum - 1
            return int(value) if base is int else float(value)
        if isinstance(c, Between):
            return int(c.high) + 1 if base is int else float(c.high) + 1.0
        if isinstance(c, OneOf):
            return "no-such-name"
        if isinstance(c, DeviceName):
            return "gpu9"
        if isinstance(c, URLScheme):
            return "ftp://nowhere"
    return None


def valid(option: Option):
    """A value the option takes: its default, or for a required one a value of its type."""
    if not option.required:
        return option.default
    return "http://127.0.0.1:1" if any(isinstance(c, URLScheme) for c, _ in _constraints(option)) else "x"


def bad_cases(options: dict) -> dict[str, tuple[str, object]]:
    """``{case: (key, value)}``: a typo of an option's name, a wrong type, a value out of range."""
    name = sorted(options)[0]
    wrong = next(k for k in sorted(options) if not fits(NOT_A_SCALAR, options[k].type))
    ranged = next((k for k in sorted(options) if out_of_range(options[k]) is not None), None)
    assert ranged is not None, f"declares no option with a range or a set of values: {sorted(options)}"
    return {"typo": (name + "_x", 1), "type": (wrong, NOT_A_SCALAR), "range": (ranged, out_of_range(options[ranged]))}


def _refused(build, key: str):
    with pytest.raises(ConfigError) as e:
        build()
    msg = str(e.value)
    assert "\n" not in msg and key in msg, msg
    return msg


@pytest.mark.parametrize("case", ["typo", "type", "range"])
@pytest.mark.parametrize("pipeline", MODELS.names())
def test_every_model_checks_its_options(pipeline, case):
    adapter = policy_class(pipeline)
    own = {k: o for k, o in adapter.declared_options().items() if k not in adapter.options_elsewhere}
    key, value = bad_cases(own)[case]
    msg = _refused(lambda: ModelConfig(pipeline=pipeline, options={key: value}), f"model.options.{key}")
    assert ("Valid:" in msg) if case == "typo" else ("must be" in msg)


@pytest.mark.parametrize("case", ["typo", "type", "range"])
@pytest.mark.parametrize("reward", REWARDS.names())
def test_every_reward_checks_its_options(reward, case):
    options, _ = reward_options(reward)
    key, value = bad_cases(options)[case]
    given = {k: valid(o) for k, o in options.items() if o.required}
    RewardConfig(weights={reward: 1.0}, options={reward: given})  # the required options alone are valid
    for section in ("options", "heldout"):
        kw = {"weights": {reward: 1.0}, section: {reward: {**given, key: value}}}
        if section == "heldout":
            kw["weights"] = {"jpeg_compressibility": 1.0}
        _refused(lambda: RewardConfig(**kw), f"reward.{section}.{reward}.{key}")


@pytest.mark.parametrize("case", ["typo", "type", "range"])
@pytest.mark.parametrize("sampler", SAMPLERS.names())
def test_every_sampler_checks_its_options(sampler, case):
    from flowrl.options import declared

    key, value = bad_cases(declared(SAMPLERS.get(sampler))[0])[case]
    _refused(lambda: SamplerConfig.from_dict({"name": sampler, key: value}), f"sampler.{key}")


def test_a_required_reward_option_left_out_is_named():
    msg = _refused(lambda: RewardConfig(weights={"hps": 1.0}), "checkpoint")
    assert "hps" in msg


@pytest.mark.parametrize("verb,argv,key", [
    ("train", ["train", "--config", "digits", "--output-dir", "{out}", "model.options.shfit=2"], "model.options.shfit"),
    ("train", ["train", "--config", "digits", "--output-dir", "{out}", "reward.options.digits.device=gpu9"],
     "reward.options.digits.device"),
    ("train", ["train", "--config", "digits", "--output-dir", "{out}", "sampler.noise_level=high"],
     "sampler.noise_level"),
    ("plan", ["plan", "--config", "recipes/wan22_group_pickscore.yaml", "--json", "{out}/plan.json",
              "model.options.train_experts=[medium]"], "model.options.train_experts"),
])
def test_the_command_line_says_it_in_one_line_and_writes_nothing(verb, argv, key, tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "out"
    code = main([a.replace("{out}", str(out)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"flowrl {verb}: error: ") and key in err[0], err
    assert not out.exists()


def test_what_a_user_reads_about_an_update_is_its_own_declaration(capsys):
    """`flowrl train --help` and train.loss's help list every registered update with the one-line summary its
    class declares (each its own, not a parent's); `bench methods` has a row per update (tests/test_bench_methods.py)."""
    import dataclasses

    from flowrl.cli import main
    from flowrl.trainers.config import TrainConfig
    from flowrl.updates import UPDATES

    with pytest.raises(SystemExit) as e:  # argparse's --help
        main(["train", "--help"])
    assert e.value.code == 0
    shown = capsys.readouterr().out
    loss_help = next(f.metadata["help"] for f in dataclasses.fields(TrainConfig) if f.name == "loss")
    for name in UPDATES.entries:
        cls = UPDATES.get(name)
        assert "summary" in vars(cls) and cls.summary, f"{cls.__name__} declares no summary of its own"
        assert f"  {name:<13} {cls.summary}" in shown and f"{name!r}: {cls.summary}" in loss_help
