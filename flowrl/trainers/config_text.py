"""Recipe text: dotted ``section.key=value`` overrides, YAML number fixes, shipped recipe lookup.

Pure functions on dicts and paths; ``config.load_config`` puts them together.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .config_base import SECTION_NAMES
from ..errors import ConfigError


def override_key(text: str) -> str:
    """The dotted key of a ``section.key=value`` override (``"train.lr=3e-4"`` -> ``"train.lr"``)."""
    return text.split("=", 1)[0].strip()


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.lr=3e-4"`` -> (["train", "lr"], 3e-4); values parse as YAML. A whole section may be
    replaced by a mapping: ``"sampler={name: ode, group_size: 8}"`` -> (["sampler"], {...})."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. train.lr=3e-4")
    key, val = override_key(text), text.split("=", 1)[1]
    parts = key.split(".")
    try:
        value = yaml.safe_load(val) if val.strip() else ""
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({problem}); balance its brackets and "
                          f"quote the whole override for the shell, e.g. \"sampler={{name: ode, group_size: 8}}\"") from None
    if len(parts) == 1 and parts[0] in SECTION_NAMES and isinstance(value, dict):
        return parts, value
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override key {key!r} must be dotted, like train.lr or sampler.group_size (or a whole "
                          f"section given a mapping, like sampler={{name: ode, group_size: 8}})")
    return parts, value


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """A deep copy of ``d`` with each ``section.key=value`` override applied in order."""
    d = yaml.safe_load(yaml.safe_dump(d))  # deep copy
    for o in overrides:
        parts, v = parse_override(o)
        cur = d
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
            if not isinstance(cur, dict):
                raise ConfigError(f"override {o!r}: {p} is not a section")
        cur[parts[-1]] = v
    return d


def moved_key_hint(key: str) -> str:
    """For a key that moved into an update's options (each update's ``Options.moved`` declares its own):
    where it lives now (empty for any other key)."""
    from ..updates import UPDATES, moved_key_table

    table = moved_key_table()
    if key not in table:
        return ""
    opt, losses = table[key]
    owners = "every train.loss" if len(losses) == len(UPDATES.entries) else f"train.loss: {' / '.join(losses)}"
    return f" It is an option of the update now: train.loss_options.{opt} ({owners})."


def upgrade_saved_config(d: dict) -> dict:
    """A run's ``config.yaml`` written before the updates owned their options, in today's keys (a copy):
    each moved key goes into ``train.loss_options`` when the run's update declares it (dropped otherwise, as
    it was unused), and a run whose loss does not consume what its mode trains on (an offline run saved
    with the online default) gets its mode's default loss. Recipes are not upgraded: a moved key there is
    an error that names its new place (:func:`moved_key_hint`)."""
    from ..updates import DEFAULT_LOSS, MODE_INPUT, UPDATES, default_needs, moved_key_table
    from ..updates.base import moved_keys

    d = yaml.safe_load(yaml.safe_dump(d))  # deep copy
    train, offline = d.setdefault("train", {}) or {}, d.get("offline") or {}
    mode = train.get("mode", "online")
    loss = train.get("loss")
    if mode in MODE_INPUT and (loss is None or (loss in UPDATES and default_needs(loss).consumes != MODE_INPUT[mode])):
        train["loss"] = loss = DEFAULT_LOSS[mode]
    own = moved_keys(UPDATES.get(loss).Options) if loss in UPDATES else {}
    opts = dict(train.get("loss_options") or {})
    for key in moved_key_table():
        section, name = key.split(".")
        sec = train if section == "train" else offline
        if name in sec:
            value = sec.pop(name)
            if key in own:
                opts.setdefault(own[key], value)
    train["loss_options"] = opts
    d["train"] = train
    return d


def _fix_floats(d):
    """PyYAML reads ``3e-4`` (no dot) as a string; turn such strings into floats."""
    if isinstance(d, dict):
        return {k: _fix_floats(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_fix_floats(v) for v in d]
    if isinstance(d, str):
        try:
            return float(d) if any(c in d for c in "eE") and d.strip()[0] in "0123456789-+." else d
        except ValueError:
            return d
    return d


def recipes_dir() -> Path:
    """The shipped recipes: ``flowrl/recipes`` in an installed wheel, ``recipes/`` in a checkout."""
    installed = Path(__file__).resolve().parents[1] / "recipes"
    return installed if installed.is_dir() else Path(__file__).resolve().parents[2] / "recipes"


def shipped_recipes() -> list[Path]:
    root = recipes_dir()
    return sorted(root.glob("*.yaml")) if root.is_dir() else []


def resolve_recipe(path: Union[str, Path]) -> Path:
    """A recipe file: ``path`` itself if it exists, else the shipped recipe of that file name."""
    p = Path(path)
    if p.is_file():
        return p
    name = p.name if p.suffix in (".yaml", ".yml") else p.name + ".yaml"
    shipped = recipes_dir() / name
    if shipped.is_file() and (len(p.parts) == 1 or p.parent.name == "recipes"):
        return shipped
    raise ConfigError(f"recipe {str(path)!r} not found. Shipped recipes (give a name or a path): "
                      f"{', '.join(r.name for r in shipped_recipes()) or '(none)'}")


def read_recipe(path: Union[str, Path]) -> dict:
    """The mapping of sections a recipe file (or shipped recipe name, :func:`resolve_recipe`) holds. An
    empty file, a YAML list or a plain string is a :class:`ConfigError` (an empty recipe would otherwise
    train the defaults without a word)."""
    p = resolve_recipe(path)
    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {path} is not valid YAML: {e}") from None
    example = "start from a shipped recipe, e.g. --config digits (recipes/digits.yaml)"
    if d is None:
        raise ConfigError(f"recipe {path} is empty: it needs sections such as model:, sampler:, train:; {example}")
    if not isinstance(d, dict):
        kind = {list: "a YAML list", str: "a plain string"}.get(type(d), f"a YAML {type(d).__name__}")
        raise ConfigError(f"recipe {path} holds {kind}, not a mapping of sections (model:, sampler:, train:, "
                          f"...); {example}")
    return d


def keep_loss_options_of_new_loss(d: dict, recipe_loss: Optional[str], overrides: list[str]) -> None:
    """``train.loss=X`` on the command line over a recipe of another loss (``recipe_loss``: the recipe's
    own, or its mode's default), with no ``train.loss_options``
    given there: the recipe's loss options that X takes are kept and the others dropped, both said in one line on
    stderr (so ``--config digits train.loss=dpo`` runs, and ``grpo`` -> ``grpo_guard`` keeps the shared clip
    range)."""
    import sys

    from ..updates import UPDATES

    train = d.get("train")
    keys = [override_key(o) for o in overrides]
    if not isinstance(train, dict) or "train.loss" not in keys:
        return
    if any(k.startswith("train.loss_options") for k in keys):
        return
    loss, options = train.get("loss"), train.get("loss_options")
    if loss == recipe_loss or not isinstance(options, dict) or not options or loss not in UPDATES.entries:
        return
    valid = {f.name for f in dataclasses.fields(UPDATES.get(loss).Options)}
    dropped = sorted(k for k in options if k not in valid)
    kept = sorted(k for k in options if k in valid)
    train["loss_options"] = {k: v for k, v in options.items() if k in valid}
    # one rule for every update, said in one line: an option the new loss takes is kept, any other dropped
    said = [f"kept where {loss} takes them ({', '.join(kept)})" if kept else "",
            f"dropped where it does not ({', '.join(dropped)})" if dropped else ""]
    print(f"[flowrl] train.loss={loss} on the command line: the recipe's train.loss_options for {recipe_loss} are "
          f"{' and '.join(filter(None, said))}; set train.loss_options=... to choose them", file=sys.stderr,
          flush=True)
