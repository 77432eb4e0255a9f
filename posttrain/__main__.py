"""``python -m posttrain ...`` (and ``torchrun --nproc_per_node N -m posttrain grpo CONFIG``): the CLI."""

import sys

from posttrain.cli import main

sys.exit(main())
