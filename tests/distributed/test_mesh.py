"""ParallelDims validation and the mesh's ranks on 2 gloo processes."""

import pytest

from pretrain.config import ConfigError, load_config
import torch

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.data import gather_samples, shard_bounds
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.launch import run_ranks

pytestmark = pytest.mark.core


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(ValueError, match=r"dp_replicate=2 x dp_shard=2 x cp=1 x sp=1 x tp=1 = 4 != world size 2"):
        ParallelDims(dp_replicate=2, dp_shard=2).resolved(2)
    with pytest.raises(ValueError, match=r"sp=4 x tp=1 = 4 does not divide the world size 2"):
        ParallelDims(sp=4).resolved(2)
    with pytest.raises(ValueError, match=r"cp=1 x sp=1 x tp=4 = 4 does not divide the world size 6"):
        ParallelDims(tp=4).resolved(6)
    for a, b in (("sp", "tp"), ("sp", "cp"), ("cp", "tp")):
        with pytest.raises(ValueError, match=rf"parallel.{a}=2 with parallel.{b}=2: these two do not compose"):
            ParallelDims(**{a: 2, b: 2}).resolved(4)
    assert ParallelDims(cp=2).resolved(4) == ParallelDims(1, 2, 1, 1, 2)
    assert ParallelDims(sp=2).resolved(8) == ParallelDims(1, 4, 2, 1)
    assert ParallelDims(tp=2).resolved(8) == ParallelDims(1, 4, 1, 2)
    assert ParallelDims(dp_replicate=2).resolved(8).dp == 8


def test_parallel_config_validation(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("dp_shard: 0\n")
    with pytest.raises(ConfigError, match="dp_shard: must be >= 1 or -1"):
        load_config(ParallelConfig, path)
    with pytest.raises(ConfigError, match="param_dtype: 'fp8' is not one of"):
        load_config(ParallelConfig, None, ["param_dtype=fp8"])
    assert load_config(ParallelConfig, None, ["sp=2"]).dims() == ParallelDims(1, -1, 2)
    assert load_config(ParallelConfig, None, ["tp=2"]).dims() == ParallelDims(1, -1, 1, 2)
    with pytest.raises(ConfigError, match=r"sp=2 with .*tp=2"):
        load_config(ParallelConfig, None, ["sp=2", "tp=2"])


def _ranks(rank, world):
    out = {}
    for name, dims in {"fsdp": ParallelDims(), "sp": ParallelDims(dp_shard=1, sp=2),
                       "hsdp": ParallelDims(dp_replicate=2, dp_shard=1), "tp": ParallelDims(dp_shard=1, tp=2),
                       "cp": ParallelDims(dp_shard=1, cp=2)}.items():
        mesh = dims.build_mesh()
        out[name] = (mesh.dp_rank, mesh.dp_size, mesh.sp_rank, mesh.sp_size, tuple(mesh.fsdp_mesh().shape),
                     mesh.device_mesh.mesh_dim_names, mesh.tp_mesh().get_local_rank(), mesh.tp_size,
                     mesh.cp_mesh["ulysses"].get_local_rank(), mesh.cp_mesh["ulysses"].size())
    mesh = ParallelDims().build_mesh()
    start, stop = shard_bounds(6, mesh.dp_rank, mesh.dp_size)
    rewards = torch.arange(start, stop, dtype=torch.float32) * 10  # stands for per-sample rewards
    rewards[0] = float("nan") if rank == 1 else rewards[0]
    out["gathered"] = gather_samples(rewards, mesh.dp_group)
    try:
        ParallelDims(dp_shard=4).build_mesh()
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_shard_bounds():
    assert [shard_bounds(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="6 items do not split evenly over 4"):
        shard_bounds(6, 0, 4)


def test_mesh_ranks_and_sample_gather_on_two_processes():
    results = run_ranks(_ranks)
    names = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
    for rank, got in enumerate(results):
        assert got["fsdp"] == (rank, 2, 0, 1, (2,), names, 0, 1, 0, 1)  # data split over both ranks
        assert got["sp"] == (0, 1, rank, 2, (2,), names, 0, 1, 0, 1)  # one data shard, tokens split, FSDP over both
        assert got["hsdp"] == (rank, 2, 0, 1, (2, 1), names, 0, 1, 0, 1)  # 2-D mesh: replicate x shard
        assert got["tp"] == (0, 1, 0, 1, (1,), names, rank, 2, 0, 1)  # one data shard, layers split
        assert got["cp"] == (0, 1, 0, 1, (2,), names, 0, 1, rank, 2)  # one data shard, tokens split, FSDP over both
        torch.testing.assert_close(got["gathered"], torch.tensor([0.0, 10, 20, float("nan"), 40, 50]), rtol=0, atol=0,
                                   equal_nan=True)  # rank order = single-process order
        assert got["error"] == "parallel: dp_replicate=1 x dp_shard=4 x cp=1 x sp=1 x tp=1 = 4 != world size 2"
