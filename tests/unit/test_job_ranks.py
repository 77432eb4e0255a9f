"""JobRanks checks that need no process group (a stand-in mesh with the degrees they read)."""

from types import SimpleNamespace

import pytest
import torch

from pretrain.config import ConfigError
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.job import JobRanks
from pretrain.runtime.low_precision import LowPrecisionConfig

pytestmark = pytest.mark.core


def test_low_precision_with_tensor_parallelism_is_refused_before_converting():
    ranks = JobRanks(SimpleNamespace(tp_size=2, sp_size=1), torch.device("cpu"))
    model = torch.nn.Linear(16, 16)
    with pytest.raises(ConfigError, match=r"train.low_precision.recipe=fp8_rowwise with parallel.tp=2"):
        ranks.shard(model, None, ParallelConfig(tp=2), low_precision=LowPrecisionConfig("fp8_rowwise", emulate=True))
    assert type(model) is torch.nn.Linear  # nothing converted


def test_compile_with_tensor_parallelism_is_refused():
    ranks = JobRanks(SimpleNamespace(tp_size=2, sp_size=1), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"parallel.compile / perf.compile with parallel.tp=2"):
        ranks.shard(torch.nn.Linear(4, 4), None, ParallelConfig(tp=2), compile_blocks=True)
