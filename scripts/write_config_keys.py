"""Write ``posttrain/config_keys.json``: the key trees of every stage's config schema, which the CLI checks
a config's keys against before it imports torch (:mod:`pretrain.config_keys`). Run after adding, removing
or renaming a config field: ``python scripts/write_config_keys.py`` (tests/unit/test_cli_errors.py fails
until then)."""

from pathlib import Path

from posttrain.stages import STAGES, get_stage
from pretrain.config_keys import write_snapshot

OUT = Path(__file__).resolve().parents[1] / "posttrain" / "config_keys.json"

if __name__ == "__main__":
    write_snapshot({command: get_stage(command)[0] for command in STAGES}, OUT)
    print(f"wrote {OUT}")
