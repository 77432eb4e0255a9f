"""Write the OpenMoji captions as a prompt set (``train.txt`` / ``test.txt``, split by base emoji as the
image set is) for real-model configs: ``data.source: prompts`` then needs no image rendering.

    python scripts/openmoji_prompts.py configs/prompts/openmoji
"""

from __future__ import annotations

import sys
from pathlib import Path

from pretrain.data import emoji as E


def main(out: str, heldout_fraction: float = 0.05) -> None:
    records, _ = E.list_emoji()
    split = {"train.txt": [], "test.txt": []}
    for r in records:
        split["test.txt" if E.is_heldout(r.base, heldout_fraction) else "train.txt"].append(r.caption)
    Path(out).mkdir(parents=True, exist_ok=True)
    for name, captions in split.items():
        (Path(out) / name).write_text("\n".join(dict.fromkeys(captions)) + "\n")
        print(f"{out}/{name}: {len(dict.fromkeys(captions))} prompts")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "configs/prompts/openmoji")
