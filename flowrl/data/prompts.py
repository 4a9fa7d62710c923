"""Prompt sets: a list, a text file (one prompt per line), a JSONL file ({"prompt": ...}), a
Hugging Face dataset directory written by ``save_to_disk``, or a shipped name (``digits``,
``flowgrpo-ocr-sample``, ... : see :data:`NAMED` and ``flowrl/data/prompt_sets/README.md``).

A file's suffix alone says how it is read (case-insensitive): ``.txt`` or no suffix, one prompt per
line (every line, a first line that reads like a header included); ``.jsonl``, one JSON row per line.
Any other suffix (``.yaml``, ``.json``, ``.csv``, ...) is a :class:`PromptSetError` naming these
forms: such a file read line by line would train on its syntax. (``flowrl eval --suite`` also reads a
``.csv`` table, :mod:`flowrl.eval.suites`.)

An editing set is a JSONL file whose rows also name a source ``image`` ({"prompt": ..., "image":
...}, :func:`flowrl.data.items.load_edit_set`): it loads as :class:`flowrl.data.items.PromptItem` s
(instruction + source image), which samplers, rewards and the offline dataset carry unchanged."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from .items import PromptItem, is_edit_row, load_edit_set

SETS_DIR = Path(__file__).resolve().parent / "prompt_sets"

BUILTIN = {
    "digits": [f"a handwritten digit {d}" for d in range(10)],
}
# shipped samples of the peers' prompt sets (provenance and licences in prompt_sets/README.md)
NAMED = {
    "flowgrpo-ocr-sample": "flowgrpo_ocr_sample.txt",
    "flowgrpo-pickscore-sample": "flowgrpo_pickscore_sample.txt",
    "geneval-sample": "geneval_sample.jsonl",
    "geneval": "geneval_metadata.jsonl",  # GenEval's 553 evaluation prompts with their clauses
    "flowgrpo-ocr-test": "flowgrpo_ocr_test.txt",  # Flow-GRPO's 1,018 OCR test prompts
    "digits-edit-sample": "digits_edit_sample.jsonl",
    "digits-edit-multi-sample": "digits_edit_multi_sample.jsonl",  # two or three source images per row
    # the shapes world's GenEval rows (flowrl.data.shapes.write_shapes_sets writes them)
    "shapes-train": "shapes_train.jsonl",  # 209 training prompts
    "shapes": "shapes_heldout.jsonl",  # 21 held-out prompts (2-4 per tag)
    "shapes-geneval": "shapes_geneval.jsonl",  # all 230
}
# columns tried, in order, when a dataset's prompt column is not named
PROMPT_COLUMNS = ("prompt", "caption", "text")
# a row's tag (GenEval's ``tag``, DrawBench's ``Category``): the first of these present
TAG_FIELDS = ("tag", "category", "Category")
UNTAGGED = "all"  # the tag of a row without one, in a set where other rows have one


class PromptSetError(ValueError):
    """A prompt set cannot be read (empty, not UTF-8, a row without the prompt field, ...); the
    message names the file and the fix. (A missing file raises ``FileNotFoundError``.)"""


def available_sets() -> list[str]:
    """Names ``load_prompts`` accepts without a path."""
    return sorted([*BUILTIN, *NAMED])


def load_prompts(source: Union[str, list, tuple], column: Optional[str] = None, split: Optional[str] = None) -> list:
    """Prompts from ``source``; errors say what was wrong (missing file, empty set, bad line).

    ``column`` names the prompt field of a JSONL file or dataset (default: the first of
    ``prompt``, ``caption``, ``text`` present); ``split`` picks a split of a saved ``DatasetDict``
    (default ``train``, or its only split).
    """
    if isinstance(source, (list, tuple)):
        prompts = list(source)
    elif source in BUILTIN:
        prompts = list(BUILTIN[source])
    elif source in NAMED:
        return load_prompts(str(SETS_DIR / NAMED[source]), column=column)
    else:
        p = Path(str(source)).expanduser()
        if p.is_dir():
            prompts = _load_hf_dataset(p, column, split)
        elif not p.is_file():
            raise FileNotFoundError(f"prompt file {str(source)!r} not found; give a .txt (one prompt per line), "
                                    f"a .jsonl with a 'prompt' field, a Hugging Face dataset directory "
                                    f"(save_to_disk), a list, or one of {available_sets()}")
        else:
            prompts = _load_file(p, column)
    bad = [i for i, x in enumerate(prompts) if not isinstance(x, (str, PromptItem))]
    if bad:
        raise PromptSetError(f"prompt {bad[0]} of {source!r} is {type(prompts[bad[0]]).__name__}, expected a string")
    if not prompts:
        raise PromptSetError(f"prompt set {str(source)!r} is empty; add at least one prompt (one per line in a .txt file)")
    return prompts


# the suffixes of a prompt file, lower case ("": a name without one): one prompt per line, or JSONL
LINE_SUFFIXES, JSONL_SUFFIX = (".txt", ""), ".jsonl"
FILE_FORMS = (".txt (one prompt per line), a .jsonl (a 'prompt' field per row; an editing set adds 'image'), "
              "or a Hugging Face dataset directory (save_to_disk)")


def _load_file(p: Path, column: Optional[str]) -> list:
    kind = p.suffix.lower()
    if kind not in (*LINE_SUFFIXES, JSONL_SUFFIX):
        raise PromptSetError(f"prompt file {p}: a {kind} file is not a prompt set; give a {FILE_FORMS} (the "
                             f"suffix says how a file is read)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PromptSetError(f"prompt file {p} is not UTF-8 ({e}); re-save it as UTF-8") from None
    if kind != JSONL_SUFFIX:
        return [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    try:
        if is_edit_row(json.loads(first)):
            return load_edit_set(p)  # instruction + source image per row
    except json.JSONDecodeError:
        pass  # reported with its line below
    prompts = []
    for i, rec in jsonl_rows(text, p):
        if not isinstance(rec, dict):
            prompts.append(rec)
            continue
        key = column or next((c for c in PROMPT_COLUMNS if c in rec), None)
        if key is None or key not in rec:
            raise PromptSetError(f"{p}:{i}: each JSONL line needs a {column or 'prompt'!r} field "
                             f"(found {sorted(rec)}); name the field with data.prompt_column")
        prompts.append(rec[key])
    return prompts


def load_prompt_tags(source: Union[str, list, tuple]) -> Optional[list[str]]:
    """The tag of each prompt of ``source`` (a shipped name or a ``.jsonl`` file whose rows carry a
    :data:`TAG_FIELDS` field, e.g. GenEval's ``tag``), in :func:`load_prompts`' order; :data:`UNTAGGED` for a
    row without one. None when the set carries no tags (a list, a built-in or ``.txt`` set, a dataset
    directory, an editing set, a ``.jsonl`` without tags): nothing is read for those but the file's rows."""
    if isinstance(source, (list, tuple)) or source in BUILTIN:
        return None
    p = SETS_DIR / NAMED[source] if source in NAMED else Path(str(source)).expanduser()
    if p.suffix.lower() != JSONL_SUFFIX or not p.is_file():
        return None
    rows = [rec for _, rec in jsonl_rows(p.read_text(encoding="utf-8"), p)]
    if not rows or is_edit_row(rows[0]):
        return None
    tags = [next((str(r[k]) for k in TAG_FIELDS if r.get(k)), None) if isinstance(r, dict) else None for r in rows]
    return None if all(t is None for t in tags) else [t or UNTAGGED for t in tags]


def jsonl_rows(text: str, where) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed row)`` of each non-blank line of a JSONL text; a line that is not JSON is
    a :class:`PromptSetError` naming ``where`` and the line."""
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptSetError(f"{where}:{i}: not valid JSON ({e})") from None


def _load_hf_dataset(p: Path, column: Optional[str], split: Optional[str]) -> list:
    """Prompts from ``datasets.load_from_disk(p)`` (a ``Dataset`` or a ``DatasetDict``)."""
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if not any((p / m).is_file() for m in markers):
        raise FileNotFoundError(f"{p} is a directory but not a saved Hugging Face dataset (no {' / '.join(markers)}); "
                                f"write it with Dataset.save_to_disk(...) or give a .txt / .jsonl file")
    try:
        import datasets
    except ImportError:
        raise PromptSetError(f"{p} is a Hugging Face dataset; reading it needs the `datasets` package: "
                          f"pip install 'flowrl[data]' (or pip install datasets)") from None
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        name = split or ("train" if "train" in ds else names[0] if len(names) == 1 else None)
        if name is None or name not in ds:
            raise PromptSetError(f"{p} holds splits {names}; choose one with data.prompt_split"
                             + (f" ({split!r} is not among them)" if split else ""))
        ds = ds[name]
    elif split is not None:
        raise PromptSetError(f"{p} is a single dataset without splits; remove data.prompt_split={split!r}")
    cols = list(ds.column_names)
    key = column or next((c for c in PROMPT_COLUMNS if c in cols), None)
    if key is None or key not in cols:
        raise PromptSetError(f"{p}: no prompt column {column or ' / '.join(PROMPT_COLUMNS)!r}; its columns are {cols}. "
                         f"Name the column with data.prompt_column")
    return list(ds[key])
