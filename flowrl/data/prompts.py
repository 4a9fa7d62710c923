"""Prompt sets: a list, a text file (one prompt per line), a JSONL file ({"prompt": ...}), or a
built-in name (``digits``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

BUILTIN = {
    "digits": [f"a handwritten digit {d}" for d in range(10)],
}


def load_prompts(source: Union[str, list, tuple]) -> list[str]:
    """Prompts from ``source``; errors say what was wrong (missing file, empty set, bad line)."""
    if isinstance(source, (list, tuple)):
        prompts = list(source)
    elif source in BUILTIN:
        prompts = list(BUILTIN[source])
    else:
        p = Path(str(source)).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"prompt file {str(source)!r} not found; give a .txt (one prompt per line), "
                                    f"a .jsonl with a 'prompt' field, a list, or one of {sorted(BUILTIN)}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"prompt file {p} is not UTF-8 ({e}); re-save it as UTF-8") from None
        if p.suffix == ".jsonl":
            prompts = []
            for i, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    prompts.append(rec["prompt"] if isinstance(rec, dict) else rec)
                except (json.JSONDecodeError, KeyError) as e:
                    raise ValueError(f"{p}:{i}: each JSONL line needs a 'prompt' field ({e})") from None
        else:
            prompts = [ln.strip() for ln in text.splitlines() if ln.strip()]
    bad = [i for i, x in enumerate(prompts) if not isinstance(x, str)]
    if bad:
        raise ValueError(f"prompt {bad[0]} of {source!r} is {type(prompts[bad[0]]).__name__}, expected a string")
    if not prompts:
        raise ValueError(f"prompt set {source!r} is empty; add at least one prompt")
    return prompts
