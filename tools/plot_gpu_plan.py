"""docs/img/gpu_plan_vs_measured.png from the GPU session's ``flowrl plan --measure`` JSONs (docs/memory.md).

    python tools/plot_gpu_plan.py [DOCS_DIR]

SD3.5-Medium's measured figures held 864.0 MiB of a float32 position-table base that flowrl's random-weight
builder kept alive then (fixed since); the figure shows them as measured and, hatched, without that table
(derived, not re-measured).
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LEAK_MIB = 384 * 384 * 1536 * 4 / 2 ** 20  # SD3.5-M's float32 position table: 864.0 MiB
CASES = (("gpu_plan_sd35m.json", "train", "SD3.5-M\ntraining step", True),
         ("gpu_plan_sd35m_ckpt.json", "train", "SD3.5-M\ntraining step\n+ checkpointing", True),
         ("gpu_plan_sd35m.json", "infer", "SD3.5-M\nsampling forward", True),
         ("gpu_plan_flux.json", "train", "FLUX.1-dev\ntraining step\n+ checkpointing", False),
         ("gpu_plan_flux.json", "infer", "FLUX.1-dev\nsampling forward", False))


def main(docs: Path) -> Path:
    fig, ax = plt.subplots(figsize=(10, 4.8))
    for i, (name, part, label, leaked) in enumerate(CASES):
        m = json.loads((docs / name).read_text())["measured"]
        planned, measured = m[part]["planned_bytes"] / 2 ** 20, m[part]["measured_bytes"] / 2 ** 20
        ax.bar(i - 0.27, planned / 1024, 0.27, color="#4c72b0", label="planned" if i == 0 else None)
        ax.bar(i, measured / 1024, 0.27, color="#dd8452", label="measured" if i == 0 else None)
        note = f"{100 * (planned - measured) / measured:+.1f}%"
        if leaked:
            fixed = measured - LEAK_MIB
            ax.bar(i + 0.27, fixed / 1024, 0.27, color="#dd8452", hatch="//", alpha=0.6,
                   label="measured without the leaked fp32 table (derived)" if i == 0 else None)
            note += f"\n{100 * (planned - fixed) / fixed:+.1f}%"
        ax.text(i, max(planned, measured) / 1024 + 0.6, note, ha="center", fontsize=8)
        ax.set_xticks(range(len(CASES)), [c[2] for c in CASES], fontsize=8)
    ax.set_ylabel("peak GiB (torch.cuda.max_memory_allocated)")
    ax.set_title("flowrl plan vs measured on an NVIDIA H200 (bf16, LoRA, random weights; error = planned / measured - 1)",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, 34)
    out = docs / "img" / "gpu_plan_vs_measured.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs")))
