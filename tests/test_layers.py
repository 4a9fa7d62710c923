"""Layers import downward only (flowrl.layers): every module under flowrl/, pipelines/ and rewards/
imports nothing from a layer above its own, at module level or inside a function, and no modules
import each other in a circle (lazy imports included)."""
from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.layers import (LAYERS, adapter_imports, check_tree, discover, import_cycles, imports_of, layer_name,
                           layer_of, module_graph, upward_imports)

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_imports_downward_only():
    bad = check_tree(ROOT)
    assert not bad, "upward imports (see flowrl/layers.py and docs/design.md, Layers):\n" + "\n".join(bad)


def test_no_import_cycles_counting_lazy_imports():
    cycles = import_cycles(module_graph(ROOT))
    assert cycles == [], "modules that import each other (a lazy import counts too):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_loops_through_lazy_imports():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    src = "def f():\n    from flowrl.rollout import ode\n"  # inside a function: still an edge
    assert {e.target for e in imports_of(src, "flowrl.sde", known={"flowrl.rollout.ode"})} == {"flowrl.rollout.ode"}


def test_no_trainer_module_sits_below_the_trainers():
    trainers = layer_of("flowrl.trainers")
    assert all(not p.startswith("flowrl.trainers") for i, (_, ps) in enumerate(LAYERS) if i != trainers for p in ps)
    below = [m for m in discover(ROOT) if m.startswith("flowrl.") and layer_of(m) < trainers]
    assert [e for m in below for e in _edges_of(m) if e.target.startswith("flowrl.trainers")] == []


def test_no_adapter_imports_another_adapter():
    """Adapters (the modules flowrl.pipelines.REGISTRY points at) share code only through pipelines modules
    no adapter owns (lazy imports count), so a model is one adapter file that depends on no other."""
    from flowrl.pipelines import REGISTRY

    adapters = {target.partition(":")[0] for target in REGISTRY.values()}
    assert {"flowrl.pipelines.flux", "flowrl.pipelines.flux_kontext", "flowrl.pipelines.wan"} <= adapters
    bad = adapter_imports(module_graph(ROOT), adapters)
    assert bad == [], "adapters importing adapters (move the shared code to a pipelines module no adapter owns):\n" + \
        "\n".join(bad)
    fake = {"flowrl.pipelines.a": {"flowrl.pipelines.packing"}, "flowrl.pipelines.b": {"flowrl.pipelines.a"},
            "flowrl.pipelines.packing": {"flowrl.pipelines.b"}, "flowrl.export": {"flowrl.pipelines.a"}}
    assert adapter_imports(fake, {"flowrl.pipelines.a", "flowrl.pipelines.b"}) == [
        "flowrl.pipelines.b imports the adapter flowrl.pipelines.a",
        "flowrl.pipelines.packing imports the adapter flowrl.pipelines.b"]  # flowrl.export may load adapters


def test_every_module_has_a_layer():
    mods = discover(ROOT)
    assert len(mods) > 50 and "flowrl.pipelines.digits" in mods and "flowrl.rewards.digits" in mods
    assert [m for m in mods if layer_of(m) is None] == []


@pytest.mark.parametrize("module, layer", [
    ("flowrl.utils.io", "utils"), ("flowrl.sde", "math"), ("flowrl.advantages.tempflow", "math"),
    ("flowrl.data.digits", "components"), ("flowrl.data.offline_store", "components"),
    ("flowrl.data.offline", "components"), ("flowrl.scoring", "scoring"), ("flowrl.conditions", "scoring"),
    ("flowrl.rollout.ode", "rollout"), ("flowrl.updates.grpo", "builders"), ("flowrl.errors", "utils"),
    ("flowrl.trainable", "training"), ("flowrl.checkpoints.sharded", "training"),
    ("flowrl.distributed.offload", "distributed"),
    ("flowrl.trainers.online", "trainers"), ("flowrl.cli", "application"), ("flowrl", "utils")])
def test_most_specific_prefix_wins(module, layer):
    assert layer_name(layer_of(module)) == layer
    assert layer_of("numpy") is None and layer_of("flowrlx.y") is None


def test_the_data_and_the_trained_model_sit_below_what_uses_them():
    """The offline dataset is handed its reward call (it imports no flowrl.scoring) and the trained model's EMA
    keeps its host copy with flowrl.utils.sharded (flowrl.trainable imports no flowrl.distributed)."""
    assert layer_of("flowrl.data.offline") < layer_of("flowrl.conditions") <= layer_of("flowrl.scoring")
    assert layer_of("flowrl.trainable") < layer_of("flowrl.distributed.offload")
    assert upward_imports(imports_of("from ..scoring import score_images\n", "flowrl.data.offline")) == [
        "flowrl.data.offline:1 (layer components) imports flowrl.scoring (layer scoring, above it)"]
    assert upward_imports(imports_of("from .distributed.offload import Offload\n", "flowrl.trainable")) == [
        "flowrl.trainable:1 (layer training) imports flowrl.distributed.offload (layer distributed, above it)"]


def test_walker_catches_an_upward_import_anywhere():
    src = ("import torch\n"
           "from ..schedules import flow_sigmas\n"         # downward: fine
           "def f():\n"
           "    from flowrl.trainers import online\n"       # upward, inside a function
           "    return online\n"
           "try:\n"
           "    from ..rollout.ode import ode_sample\n"     # upward, relative, in a try block
           "except ImportError:\n"
           "    pass\n"
           "REGISTRY = {'x': 'flowrl.trainers.online:train'}\n")  # a string: data, not an import
    edges = list(imports_of(src, "flowrl.pipelines.fake", known={"flowrl.trainers.online"}))
    assert {e.target for e in edges} == {"torch", "flowrl.schedules", "flowrl.trainers.online", "flowrl.rollout.ode"}
    bad = upward_imports(edges)
    assert len(bad) == 2
    assert bad[0] == ("flowrl.pipelines.fake:4 (layer components) imports flowrl.trainers.online "
                      "(layer trainers, above it)")
    assert bad[1].startswith("flowrl.pipelines.fake:7 (layer components) imports flowrl.rollout.ode (layer rollout")


def test_relative_imports_resolve_from_packages_and_modules():
    pkg = list(imports_of("from . import x\nfrom .sub import y\n", "flowrl.data", is_package=True))
    assert [e.target for e in pkg] == ["flowrl.data", "flowrl.data.sub"]
    mod = list(imports_of("from .. import sde\nfrom ..utils.io import write_text\n", "flowrl.rollout.group",
                          known={"flowrl.sde"}))
    assert [e.target for e in mod] == ["flowrl.sde", "flowrl.utils.io"]


def test_layer_names_are_unique():
    names = [n for n, _ in LAYERS]
    assert len(set(names)) == len(names)


def _edges_of(prefix: str):
    mods = discover(ROOT)
    for name, (path, is_pkg) in mods.items():
        if name == prefix or name.startswith(prefix + "."):
            yield from imports_of(path.read_text(), name, is_pkg, set(mods))


def test_utils_import_nothing_else_from_flowrl():
    bad = [e for e in _edges_of("flowrl.utils") if e.target.startswith("flowrl.") and
           not e.target.startswith("flowrl.utils")]
    assert bad == []


@pytest.mark.parametrize("module", ["flowrl.export", "flowrl.sampling_cli", "flowrl.bench.precision"])
def test_sampling_and_export_use_no_trainer_but_the_config(module):
    # sampling, export and the precision benchmarks build policies with flowrl.builders and read
    # checkpoints with flowrl.checkpoints; of the trainers they read only the run's config
    assert [e.target for e in _edges_of(module) if e.target.startswith("flowrl.trainers")
            and not e.target.startswith("flowrl.trainers.config")] == []
