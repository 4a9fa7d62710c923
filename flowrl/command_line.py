"""What every ``flowrl`` command line shares: the parser class (one-line errors, no abbreviations,
defaults in ``--help``), argument types, dotted overrides anywhere on the line, and the table of
user-error types that :func:`flowrl.cli.main` turns into one line ``flowrl VERB: error: ...``."""
from __future__ import annotations

import argparse
import json
import re
from typing import Any, Callable, Optional


# ---------------------------------------------------------------- the parser
_HELP_WITHOUT_DEFAULT = (None, False, [], argparse.SUPPRESS)


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Help with each option's default (unless it is None / False or the help already names it) and
    the verb's example epilog printed as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default in _HELP_WITHOUT_DEFAULT or "default" in text.lower() or "%(default)" in text
                or not (action.option_strings or action.nargs in ("?", "*"))):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """flowrl's parsers: no prefix abbreviations, defaults in ``--help``, one-line errors (rc 2).
    Sub-parsers inherit the class (``add_subparsers`` uses the parent's type)."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's contract: never returns
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {v}")
    return v


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return v


def decay(text: str) -> float:
    """argparse type: a number in [0, 1) (a moving average's decay; 0: none)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (0: no average), got {text}")
    return v


def example(*lines: str) -> str:
    """A verb's ``--help`` epilog: the example command lines, indented under ``example:``."""
    return "example:\n" + "\n".join(f"  {ln}" for ln in lines)


# ---------------------------------------------------------------- the error boundary
def one_line(text: str) -> str:
    """``text`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(str(text).split())


def _os_error(e: OSError) -> str:
    if e.filename is not None and e.strerror:  # raised by the OS: "[Errno 2] ..." -> what and where
        return f"{e.strerror.lower()}: {e.filename}"
    return str(e)


def user_errors() -> dict[type, Callable[[BaseException], str]]:
    """Exception types that mean "this cannot be done as asked" -> their one-line message. Their
    messages already say what was wrong and how to fix it; anything not listed is a bug."""
    import yaml

    from flowrl.data.embeddings import TextCacheError
    from flowrl.data.offline_store import DatasetError
    from flowrl.data.prompts import PromptSetError
    from flowrl.quant.common import BackendUnavailable
    from flowrl.checkpoints.common import CheckpointError
    from flowrl.trainers.steps import TrainingStopped
    from flowrl.errors import BenchError, ConfigError
    from flowrl.rewards import RewardUnavailable

    plain = str
    return {
        ConfigError: plain,  # also ExportError
        PromptSetError: plain,
        DatasetError: plain,
        TextCacheError: plain,
        CheckpointError: plain,
        TrainingStopped: plain,
        BackendUnavailable: plain,
        BenchError: plain,
        RewardUnavailable: plain,  # a reward server or judge endpoint that does not answer (when it is built)
        yaml.YAMLError: lambda e: f"not valid YAML ({e}); quote the value and balance its brackets",
        FileNotFoundError: _os_error,
        FileExistsError: _os_error,
        NotADirectoryError: _os_error,
        IsADirectoryError: _os_error,
        PermissionError: lambda e: f"{_os_error(e)} (check the directory's permissions or choose another path)",
        KeyboardInterrupt: lambda e: "interrupted (Ctrl-C)",
    }


def user_message(e: BaseException) -> Optional[str]:
    """The one-line message of a user error (:func:`user_errors`), or None for anything else (a bug)."""
    for kind, message in user_errors().items():
        if isinstance(e, kind):
            return one_line(message(e))
    return None


def emit(result: Any) -> None:
    """Print a handler's result on stdout: a dict or list as JSON, anything else as text."""
    if result is None or result == {}:
        return
    print(json.dumps(result, indent=2) if isinstance(result, (dict, list)) else result, flush=True)


def require_device(device, setting: str = "model.device") -> None:
    """A ``ConfigError`` when ``device`` names CUDA and no CUDA GPU is visible (torch would fail later
    with 'Found no NVIDIA driver'); ``setting`` is the name the user gave it by."""
    import torch

    from .errors import ConfigError

    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{setting}={device} but no CUDA GPU is visible here (torch.cuda.is_available() is "
                          f"False); use {setting}=auto (GPU when there is one, else CPU) or {setting}=cpu")


# ---------------------------------------------------------------- a reward's --options (serve-reward, rescore-offline)
OPTIONS_HELP = ("the reward's keyword arguments: key=value items (values read as YAML), a YAML or JSON mapping "
                "('{device: cuda:1}', '{\"device\": \"cpu\"}') or a YAML file, merged left to right")


def reward_options(items: Optional[list[str]]) -> dict:
    """``--options`` items -> the reward's keyword arguments (:data:`OPTIONS_HELP`, one reading for every
    verb: :func:`flowrl.rewards.server.parse_options`); a bad item is a ``ConfigError``."""
    import yaml

    from flowrl.rewards.server import parse_options

    from .errors import ConfigError

    try:
        return parse_options(items)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(one_line(str(e))) from None


# ---------------------------------------------------------------- overrides anywhere on the line
def _override_pattern() -> re.Pattern:
    from flowrl.trainers.config_base import SECTION_NAMES

    return re.compile(rf"^(?:{'|'.join(SECTION_NAMES)})(?:\.[\w-]+)*=")


def _sub_actions(parser: argparse.ArgumentParser) -> list:
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def verb_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub-)parser that the leading verb words of ``argv`` select (``bench offline`` -> its parser)."""
    for tok in argv:
        subs = _sub_actions(parser)
        if not subs or tok not in subs[0].choices:
            break
        parser = subs[0].choices[tok]
    return parser


def split_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` without the dotted overrides, and the overrides in order, for a verb whose parser takes
    ``overrides``; so ``train --resume train.lr=1`` and ``sample --prompts a train.lr=1`` both work. A
    token right after an option that takes a value stays that option's value."""
    verb = verb_parser(parser, argv)
    if not any(a.dest == "overrides" for a in verb._actions):
        return argv, []
    pattern, rest, overrides = _override_pattern(), [], []
    for i, tok in enumerate(argv):
        prev = verb._option_string_actions.get(argv[i - 1]) if i else None
        if pattern.match(tok) and not (prev is not None and prev.nargs != 0):
            overrides.append(tok)
        else:
            rest.append(tok)
    return rest, overrides
