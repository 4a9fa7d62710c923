"""Where the plan's items live under ``train.offload`` (:mod:`flowrl.distributed.offload`).

The budget (:mod:`flowrl.plan.budget`) counts every item on the GPU except FSDP's own CPU offload
(``train.offload.fsdp`` = ``train.cpu_offload``, which it models itself). :func:`place` then moves what
the other offload flags keep in host memory, and adds what comes back to the GPU while it is used:

* ``text_encoders``: the text encoders' row goes to the host; encoding the prompts brings them back
  for the call (a rollout transient of their size);
* ``vae``: the VAE's row goes to the host; its decode transient grows by the VAE's weights;
* ``reference``: the full fine-tune's KL reference copy (its FSDP shards) goes to the host; its
  forward gathers blocks like the trained model's (the "FSDP unsharded blocks" row covers them);
* ``ema``: the EMA row goes to the host.
"""
from __future__ import annotations

import dataclasses

from .budget import Item

# train.offload flag -> the name prefix of the budget row it moves to the host
HOST_ROWS = {"text_encoders": "text encoders", "vae": "VAE", "reference": "reference copy", "ema": "EMA ("}


def _row(items: list[Item], prefix: str) -> Item | None:
    return next((i for i in items if i.name.startswith(prefix) and i.group == "resident"), None)


def place(items: list[Item], offload: dict) -> list[Item]:
    """``items`` with the rows ``offload`` (``train.offload``) keeps in host memory moved there, plus the
    transients of bringing them back (module doc)."""
    out = list(items)
    for flag, prefix in HOST_ROWS.items():
        row = _row(out, prefix)
        if not offload.get(flag) or row is None or row.where == "host" or row.bytes == 0:
            continue
        out[out.index(row)] = dataclasses.replace(row, where="host", note=f"{row.note}; train.offload.{flag}".lstrip("; "))
        if flag == "text_encoders":
            out.append(Item("rollout: text encoders on the GPU while encoding", row.bytes, "transient", "gpu",
                            "train.offload.text_encoders: moved in for each encode call"))
        elif flag == "vae":
            dec = next((i for i in out if i.group == "transient" and "VAE decode" in i.name), None)
            if dec is not None:
                out[out.index(dec)] = dataclasses.replace(dec, bytes=dec.bytes + row.bytes,
                                                          note=f"{dec.note}; + the VAE moved in (train.offload.vae)")
    return out
