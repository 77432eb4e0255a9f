"""Optional dependencies: features that need a package outside the core install import it through
:func:`require`, which names the feature and the extra that installs it (``pip install
'posttrain[<extra>]'``; ``make`` installs them all)."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {  # module -> (pip extra, PyPI package)
    "wandb": ("wandb", "wandb"),
    "pytesseract": ("ocr", "pytesseract"),
    "open_clip": ("rewards", "open-clip-torch"),
    "imageio": ("video", "imageio"),
    "imageio.v2": ("video", "imageio"),
    "datasets": ("data", "datasets"),
    "imagehash": ("data", "imagehash"),
    "webdataset": ("data", "webdataset"),
    "pyarrow.parquet": ("data", "pyarrow"),
    "imageio.v3": ("video", "imageio"),
    "torchao": ("lowp", "torchao"),
    "ray": ("ray", "ray"),
}


class MissingExtra(ImportError):
    """A feature's optional package is not installed; the message names the feature, the package and the
    ``pip install`` line."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature`` (a phrase such as "wandb.mode: offline"); :class:`MissingExtra`
    naming the extra to install when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra, package = EXTRAS.get(module, (None, module.split(".")[0]))
        how = f"pip install 'posttrain[{extra}]'" if extra else f"pip install {package}"
        raise MissingExtra(f"{feature} needs the package {package}, which is not installed: {how}") from e
