"""The worlds ``flowrl bench methods`` runs on (``--pipeline``): a world is a declaration, one entry of
:data:`WORLDS`, and the bench asks it, never the world's name.

A world is an offline model a CPU trains in minutes with a base recipe (``recipes/<world>.yaml``: GRPO with
the world's reward, its training and evaluation prompts). The base recipe is the bench's footing (the model,
prompts, evaluation prompts and seeds, ``train.seed``) and the recipe of every method that needs none of its
own. A method that declares its digits recipe (``digits_<x>.yaml``, the update's ``digits_recipe``) runs in
world ``w`` on ``w_<x>.yaml`` (:meth:`World.method_recipe`); where that recipe is not shipped, the method falls
back as on digits (the base recipe with its overrides) or, when it runs only on its recipe, is "not available
in this build". The real data of the hacking watch (diversity, high-frequency energy, the reward of real
images) is the world's model's (``reference_images``: held-out digits, rendered shape scenes), so a world
declares nothing for it; the evaluation's tags, when its evaluation prompts carry them (the ``shapes`` set's
GenEval tags), come from the prompt set (:func:`flowrl.data.prompts.load_prompt_tags`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import BenchError
from ..trainers.config_text import recipes_dir

DIGITS_PREFIX = "digits_"  # the prefix of an update's declared recipe (``digits_recipe``)


@dataclass(frozen=True)
class World:
    """``name``: the ``--pipeline`` value and the prefix of its recipes; ``recipe``: its base recipe (a shipped
    recipe's file name); ``about``: one line for ``--help`` and the errors (what the model draws, its reward);
    ``headline``: the measure the bench ranks by when it is not the trained reward: a held-out reward of the base
    recipe (``reward.heldout``, shared by every method), e.g. GenEval's official verdict beside a trained partial
    score; ``headline_about``: what that measure is, for the table's legend."""

    name: str
    recipe: str
    about: str = ""
    headline: Optional[str] = None
    headline_about: str = ""

    def method_recipe(self, digits_recipe: Optional[str]) -> Optional[str]:
        """The recipe of a method in this world from its declared digits recipe: ``digits_<x>.yaml`` ->
        ``<world>_<x>.yaml`` (None: the method declares none)."""
        if digits_recipe is None:
            return None
        if not digits_recipe.startswith(DIGITS_PREFIX):
            raise BenchError(f"a method's digits_recipe must be named {DIGITS_PREFIX}<x>.yaml (got {digits_recipe!r}); "
                             f"rename the recipe so each world finds its own as <world>_<x>.yaml")
        return f"{self.name}_{digits_recipe.removeprefix(DIGITS_PREFIX)}"

    def check_shipped(self) -> None:
        """A one-line error when this build does not ship the world's base recipe."""
        if not (recipes_dir() / self.recipe).is_file():
            raise BenchError(f"bench methods --pipeline {self.name}: this build does not ship recipes/{self.recipe} "
                             f"(the {self.name} world's base recipe); choose another --pipeline")


WORLDS = {w.name: w for w in (
    World("digits", "digits.yaml", "the tiny offline digits model, the digits-classifier reward"),
    World("shapes", "shapes.yaml", "the offline shapes model (coloured shapes, GenEval's prompts and tags), the "
                                   "GenEval rules on the shapes detector",
          headline="geneval@official",
          headline_about="eval reward = GenEval's official verdict (1: every clause of the prompt right) on the "
                         "held-out prompts; the methods train on its partial score"),
)}


def world(name: str) -> World:
    """The world named ``name`` (a one-line error naming the worlds otherwise)."""
    if name not in WORLDS:
        raise BenchError(f"bench methods runs on the offline worlds {', '.join(WORLDS)} (got {name!r}); for SD3/FLUX "
                         f"run each method's recipe with `flowrl train` on a GPU machine")
    return WORLDS[name]
