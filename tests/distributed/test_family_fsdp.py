"""FSDP2 over the blocks of the other families' denoisers (FLUX.1 and FLUX.2 double + single blocks,
Qwen-Image's blocks, Z-Image's refiners and layers, LTX-2's audio-video blocks, a UNet's down / mid / up
blocks): 2 ranks on half a batch each equal one process on the whole batch."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from pretrain.models import denoiser_blocks
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.dims import ParallelDims
from pretrain.parallel.fsdp import parallelize
from pretrain.parallel.launch import run_ranks
from tests.distributed.common import full_grads

pytestmark = pytest.mark.core


def flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))

    def loss(m, rows):
        g = torch.Generator().manual_seed(1)
        x, txt = torch.randn(4, 16, 16, generator=g), torch.randn(4, 5, 32, generator=g)
        pooled, t = torch.randn(4, 32, generator=g), torch.rand(4, generator=g)
        ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1)
        out = m(hidden_states=x[rows], encoder_hidden_states=txt[rows], pooled_projections=pooled[rows],
                timestep=t[rows], img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(5, 3),
                guidance=torch.full((len(range(*rows.indices(4))),), 3.5), return_dict=False)[0]
        return out.pow(2).mean()
    return model, loss


def unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                                 layers_per_block=1, norm_num_groups=8, attention_head_dim=8,
                                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16)

    def loss(m, rows):
        g = torch.Generator().manual_seed(1)
        x, txt, t = torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 5, 16, generator=g), torch.tensor([10, 200, 500, 900])
        return m(x[rows], t[rows], encoder_hidden_states=txt[rows], return_dict=False)[0].pow(2).mean()
    return model, loss


def qwenimage():
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                        axes_dims_rope=(4, 6, 6))

    def loss(m, rows):
        g = torch.Generator().manual_seed(1)
        x, txt, t = torch.randn(4, 16, 16, generator=g), torch.randn(4, 5, 32, generator=g), torch.rand(4, generator=g)
        n = len(range(*rows.indices(4)))
        return m(hidden_states=x[rows], encoder_hidden_states=txt[rows], timestep=t[rows],
                 img_shapes=[[(1, 4, 4)]] * n, return_dict=False)[0].pow(2).mean()
    return model, loss


def flux2():
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                                    timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)

    def loss(m, rows):
        g = torch.Generator().manual_seed(1)
        x, txt, t = torch.randn(4, 16, 16, generator=g), torch.randn(4, 5, 48, generator=g), torch.rand(4, generator=g)
        img = torch.cartesian_prod(torch.arange(1), torch.arange(4), torch.arange(4), torch.arange(1))
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(5))
        n = len(range(*rows.indices(4)))
        out = m(hidden_states=x[rows], encoder_hidden_states=txt[rows], timestep=t[rows],
                img_ids=img.expand(n, -1, -1), txt_ids=txt_ids.expand(n, -1, -1), return_dict=False)[0]
        return out.pow(2).mean()
    return model, loss


def zimage():
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    model = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
                                     n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[4, 6, 6],
                                     axes_lens=[256, 32, 32])

    def loss(m, rows):
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(4, 4, 1, 8, 8, generator=g), torch.rand(4, generator=g)
        caps = [torch.randn(3 + i, 16, generator=g) for i in range(4)]  # captions of other lengths
        idx = range(*rows.indices(4))
        out = m([x[i] for i in idx], t[rows], [caps[i] for i in idx], return_dict=False)[0]
        return torch.stack(out).pow(2).mean()
    return model, loss


def ltx2():
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=16,
        rope_double_precision=False, rope_type="split")

    def loss(m, rows):
        g = torch.Generator().manual_seed(1)
        video, audio = torch.randn(4, 2 * 4 * 4, 4, generator=g), torch.randn(4, 3, 4, generator=g)
        text, t = torch.randn(4, 5, 16, generator=g), 1000 * torch.rand(4, generator=g)
        v, a = m(hidden_states=video[rows], audio_hidden_states=audio[rows], encoder_hidden_states=text[rows],
                 audio_encoder_hidden_states=text[rows], timestep=t[rows], sigma=t[rows], num_frames=2, height=4,
                 width=4, audio_num_frames=3, use_cross_timestep=True, return_dict=False)
        return v.pow(2).mean() + a.pow(2).mean()
    return model, loss


def _family_fsdp(rank, world, build):
    mesh = ParallelDims().build_mesh()
    ref, loss = build()
    model, _ = build()
    blocks = denoiser_blocks(model)  # the family adapter's blocks of a bare denoiser
    units = len(blocks)
    parallelize(model, mesh, ParallelConfig(), blocks=blocks)
    loss(model, slice(2 * rank, 2 * rank + 2)).backward()
    loss(ref, slice(0, 4)).backward()
    grads, want = full_grads(model), full_grads(ref)
    return dict(units=units, fsdp_modules=sum(isinstance(m, FSDPModule) for m in model.modules()),
                same_names=set(grads) == set(want),
                grad_diff=max(float((grads[k] - want[k]).abs().max()) for k in want),
                grad_max=max(float(g.abs().max()) for g in want.values()))


# FLUX.1 and FLUX.2: 1 double + 2 single blocks; Qwen-Image: 2 blocks; Z-Image: a noise refiner, a caption
# refiner and 2 joint layers; LTX-2: 2 audio-video blocks; the UNet: 2 down, mid, 2 up
@pytest.mark.parametrize("build,units", [(flux, 3), (flux2, 3), (qwenimage, 2), (zimage, 4), (ltx2, 2),
                                         pytest.param(unet, 5, marks=pytest.mark.long)])
def test_fsdp_shards_every_block_and_matches_one_process(build, units):
    for r in run_ranks(_family_fsdp, build):
        print(build.__name__, r)
        assert r["units"] == units and r["fsdp_modules"] == units + 1  # every block, then the root
        assert r["same_names"] and r["grad_max"] > 1e-4
        assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_max"]), r
