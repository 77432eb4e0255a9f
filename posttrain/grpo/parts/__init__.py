"""The built-in parts of the post-training algorithms: every module of this package is imported here,
so a part in a new file registers itself with no other edit (:mod:`posttrain.grpo.parts.registry` says
how to write one)."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
