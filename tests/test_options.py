"""flowrl.options: the checker every part's declared options go through (types as YAML gives them, ranges
on the annotations at any depth, messages that say what is valid)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional, Sequence, Union

import pytest
import torch

from flowrl.options import (AtLeast, Between, Device, Option, PositiveInt, URL, WeightsFile, check_fields,
                            check_options, check_value, declared, describe_type, fits, reads)


def _take(a: int = 1, b: Optional[float] = None, c: Literal["high", "low"] = "high",
          d: list[Annotated[int, AtLeast(0)]] = (1,), e: Annotated[int, Between(1, 4, why="four at most")] = 2,
          f: Union[torch.dtype, Annotated[str, AtLeast(0)], None] = None, g: "int | None" = None,
          h: Optional[WeightsFile] = None, *, device: Device = "cpu", url: Optional[URL] = None, **rest):
    """A callable declaring one option of each kind (``**rest``: open)."""


@pytest.mark.parametrize("key,value,ok", [
    ("a", 3, True), ("a", True, False), ("a", 1.5, False), ("a", "3", False),  # a bool is not a number
    ("b", 2, True), ("b", None, True), ("b", "high", False),
    ("c", "low", True), ("c", "medium", False), ("d", [0, 3], True), ("d", [-1], False), ("d", 3, False),
    ("e", 4, True), ("e", 5, False), ("f", torch.bfloat16, True), ("g", None, True), ("g", 2, True),
    ("g", "x", False), ("device", "cuda:1", True), ("device", "gpu9", False),
    ("url", "http://127.0.0.1:8/v1", True), ("url", "ftp://x", False), ("url", None, True),
])
def test_values_are_held_against_their_declared_type_and_range(key, value, ok):
    options, is_open = declared(_take)
    assert is_open and sorted(options) == ["a", "b", "c", "d", "device", "e", "f", "g", "h", "url"]
    if ok:
        check_value(key, options[key], value)
    else:
        with pytest.raises(ValueError, match=f"^{key} must be .*, got "):
            check_value(key, options[key], value)


def test_messages_say_what_is_valid_as_a_recipe_writes_it():
    options, _ = declared(_take)
    assert options["b"].describe() == "a number or null"
    assert options["c"].describe() == "one of 'high', 'low'"
    assert options["d"].describe() == "a list, each item an integer >= 0"
    assert options["e"].describe() == "an integer in [1, 4] (four at most)"
    assert options["device"].describe() == "a device such as 'cpu', 'cuda' or 'cuda:1'"
    assert describe_type(options["f"].type).startswith("a string")  # torch.dtype: for Python callers, not said
    assert reads(options["h"]) == "file" and reads(options["a"]) is None and not fits(3, options["h"].type)
    with pytest.raises(ValueError, match=r"^x\.aa: not an option of the test part\. Did you mean x\.a\? Valid: a, b"):
        check_options("x", "the test part", options, {"aa": 1})
    check_options("x", "the test part", options, {"anything": 1}, open=True)  # **kwargs: not refused here
    with pytest.raises(ValueError, match=r"^--options e must be an integer in \[1, 4\]"):  # a flag's item
        check_options("--options", "the test part", options, {"e": 9})
    with pytest.raises(ValueError, match=r"^x\.device: set model\.device instead"):
        check_options("x", "the test part", options, {"device": "cpu"}, elsewhere={"device": "model.device"})


@dataclass
class _Part:
    n: PositiveInt = 2
    names: Sequence[str] = ("a",)
    table: dict = field(default_factory=dict)
    _private: int = 0

    def __post_init__(self):
        check_fields(self)


def test_a_dataclass_declares_its_fields_and_checks_itself():
    options, is_open = declared(_Part)
    assert not is_open and sorted(options) == ["n", "names", "table"] and options["table"].default == {}
    assert isinstance(Option("x"), Option) and _Part(n=3).n == 3
    with pytest.raises(ValueError, match=r"^n must be an integer >= 1, got 0$"):
        _Part(n=0)
    with pytest.raises(ValueError, match=r"^names must be a list, each item a string, got 'a'$"):
        _Part(names="a")
