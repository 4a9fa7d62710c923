"""Evaluation suites: prompt sets whose rows may carry a tag and metadata (GenEval's clauses).

``--suite NAME``: a shipped set (:data:`SUITES`, licences in ``flowrl/data/prompt_sets/README.md``);
``--suite FILE``: ``.txt`` (one prompt per line), ``.jsonl`` (``prompt`` plus optional ``tag`` or
``category`` and any metadata, e.g. GenEval's ``include`` / ``exclude``; rows with an ``image`` are an
editing set) or ``.csv`` (a ``prompt`` / ``Prompts`` column and an optional ``tag`` / ``category`` /
``Category`` one, as DrawBench's sheet exports). A row that claims GenEval clauses (a GenEval tag,
``include`` or ``exclude``) must hold well-formed ones: the error names the file and line.

The suffix alone says how a file is read (case-insensitive): ``.txt`` and a name without a suffix are
one prompt per line, always, also when the first line reads like a CSV header (``prompt,tag``: that
line is then a prompt; name the file ``.csv`` to read it as a table); any other suffix (``.yaml``,
``.json``, ``.tsv``, ...) is an error naming the forms above, not a file read line by line.
"""
from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from flowrl.data.items import PromptItem, is_edit_row, load_edit_set
from flowrl.data.prompts import BUILTIN, NAMED, SETS_DIR, TAG_FIELDS, UNTAGGED, PromptSetError, jsonl_rows, load_prompts
from flowrl.errors import ConfigError
from flowrl.rewards.geneval_rules import check_metadata, has_clauses

# suite name -> (prompt set name, one line on what it is)
SUITES = {
    "geneval": ("geneval", "GenEval's 553 prompts with their clauses (tags: single_object ... color_attr)"),
    "ocr": ("flowgrpo-ocr-test", "Flow-GRPO's 1,018 OCR test prompts (quoted text to render)"),
    "digits": ("digits", "the 10 digits prompts"),
    "shapes": ("shapes", "the shapes world's 21 held-out prompts (2-4 per tag) with their GenEval clauses (flowrl.data.shapes)"),
    "shapes-geneval": ("shapes-geneval", "all 230 prompts of the shapes world with their GenEval clauses"),
    "shapes-train": ("shapes-train", "the shapes world's 209 training prompts with their GenEval clauses"),
    **{name: (name, f"shipped sample {file}") for name, file in NAMED.items()
       if name not in ("geneval", "shapes", "shapes-geneval", "shapes-train")},
}
NOT_SHIPPED = {
    "drawbench": "DrawBench is not shipped (its prompts are published without a licence); export its sheet as CSV "
                 "and pass the file: --suite DrawBench.csv (columns Prompts and Category)",
}
PROMPT_FIELDS = ("prompt", "Prompts", "Prompt", "caption", "text")


@dataclass(frozen=True)
class SuiteItem:
    """One prompt of a suite: what the model is given (text, or an editing item), its tag (None:
    untagged) and its metadata (the row's other fields)."""

    prompt: Union[str, PromptItem]
    tag: Optional[str] = None
    meta: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.prompt.prompt if isinstance(self.prompt, PromptItem) else self.prompt


@dataclass(frozen=True)
class Suite:
    name: str
    source: str
    items: tuple

    @property
    def tags(self) -> list[str]:
        """Each prompt's tag (``"all"`` for an untagged one)."""
        return [it.tag or UNTAGGED for it in self.items]

    def fingerprint(self) -> str:
        """A hash of the prompts, tags and metadata (a resumed evaluation must see the same suite)."""
        rows = [[it.text, it.tag, it.meta, str(getattr(it.prompt, "key", ""))] for it in self.items]
        return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def available_suites() -> list[str]:
    return sorted(SUITES)


def _row_item(row: dict, where: str) -> SuiteItem:
    key = next((k for k in PROMPT_FIELDS if isinstance(row.get(k), str) and row[k].strip()), None)
    if key is None:
        raise PromptSetError(f"{where}: a row needs a {' / '.join(PROMPT_FIELDS[:2])} text field, found {sorted(row)}")
    tag_key = next((k for k in TAG_FIELDS if row.get(k)), None)
    meta = {k: v for k, v in row.items() if k != key}
    if has_clauses(row):
        meta.update(check_metadata(row, where))
    return SuiteItem(row[key].strip(), str(row[tag_key]) if tag_key else None, meta)


def _read_jsonl(p: Path) -> list[SuiteItem]:
    lines = p.read_text(encoding="utf-8").splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    try:
        if is_edit_row(json.loads(first)):
            return [SuiteItem(it, next((str(it.meta[k]) for k in TAG_FIELDS if it.meta.get(k)), None), dict(it.meta))
                    for it in load_edit_set(p)]
    except json.JSONDecodeError:
        pass  # reported with its line below
    return [_row_item(row, f"{p}:{i}") if isinstance(row, dict) else SuiteItem(str(row))
            for i, row in jsonl_rows("\n".join(lines), p)]


def _read_csv(p: Path) -> list[SuiteItem]:
    with p.open(encoding="utf-8", newline="") as f:
        return [_row_item(dict(row), f"{p}:{i}") for i, row in enumerate(csv.DictReader(f), 2)
                if any((v or "").strip() for v in row.values())]


def load_suite(spec: Union[str, list]) -> Suite:
    """A suite by name or file (module doc), or a list of prompt texts (``--prompts``)."""
    if isinstance(spec, (list, tuple)):
        return Suite("prompts", "command line", tuple(SuiteItem(p) for p in load_prompts(list(spec))))
    if spec in SUITES:
        name, _ = SUITES[spec]
        path = SETS_DIR / NAMED[name] if name in NAMED else None
        if path is None:
            return Suite(spec, "built in", tuple(SuiteItem(p) for p in BUILTIN[name]))
        return Suite(spec, f"shipped: {path.name}", tuple(_load_file(path)))
    p = Path(str(spec)).expanduser()
    if not p.is_file():
        if str(spec).lower() in NOT_SHIPPED:
            raise ConfigError(NOT_SHIPPED[str(spec).lower()])
        raise ConfigError(f"unknown suite {str(spec)!r}; valid suites: {', '.join(available_suites())}, or a "
                          f".txt / .jsonl / .csv file")
    return Suite(p.stem, str(p), tuple(_load_file(p)))


FILE_FORMS = (".txt (one prompt per line), .jsonl (a 'prompt' field per row, optional 'tag' and metadata; an "
              "'image' per row for an editing suite) or .csv (a 'prompt' / 'Prompts' column, optional 'tag' / "
              "'Category')")


def _load_file(p: Path) -> list[SuiteItem]:
    kind = p.suffix.lower()
    if kind not in (".jsonl", ".csv", ".txt", ""):
        raise PromptSetError(f"suite {p}: a {kind} file is not a suite; give a {FILE_FORMS} file (the suffix "
                             f"says how it is read)")
    try:
        if kind == ".jsonl":
            items = _read_jsonl(p)
        elif kind == ".csv":
            items = _read_csv(p)
        else:  # .txt or no suffix: one prompt per line (module doc)
            items = [SuiteItem(t) for t in load_prompts(str(p))]
    except UnicodeDecodeError as e:
        raise PromptSetError(f"suite {p} is not UTF-8 ({e}); re-save it as UTF-8") from None
    if not items:
        raise PromptSetError(f"suite {p} is empty; add at least one prompt")
    return items
