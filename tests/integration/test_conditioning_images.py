"""Prompts that carry conditioning images (editing, image-to-video): the rollout records them in its
trajectory, the recomputed log-probs read the recorded ones (a swapped image changes them), both CFG
branches see them, and a family without that input refuses them instead of ignoring them."""

import pytest
import torch

from pretrain.export import load_exported
from pretrain.models.config import ModelConfig
from pretrain.models.sd3.model import SD3Adapter, build_transformer
from pretrain.text_encoder import PromptEmbeds
from rollout.config import RolloutConfig
from rollout.sampler import Sampler, log_prob
from rollout.trajectory import Trajectory

pytestmark = pytest.mark.core

STEPS = 4


def _editing_model(tiny_export):
    """The tiny preset built as an editing model (InstructPix2Pix's channel concatenation: in_channels =
    latent + source channels), with the tiny export's text encoder and codec."""
    _, encoder, codec, meta = load_exported(tiny_export)
    size, c = meta["image_size"], codec.channels
    torch.manual_seed(0)
    net = build_transformer(ModelConfig(preset="tiny", overrides={"in_channels": 2 * c}), size // codec.downsample, c,
                            encoder.dim, encoder.pooled_dim)
    return SD3Adapter(net).eval(), encoder, codec, size


def _rollout(model, encoder, codec, size, embeds, prompts):
    sampler = Sampler(RolloutConfig(noise_level=0.7, guidance_scale=3.0), model.sigmas(STEPS, 1.0),
                      encoder.encode([""]))
    return sampler.sample(model, codec, embeds, prompts, group_ids=torch.arange(len(prompts)),
                          sample_ids=list(range(len(prompts))), latent_shape=codec.latent_shape(size, size), seed=0,
                          iteration=0, device="cpu")


def test_the_conditioning_image_is_recorded_and_used_in_recomputation(tiny_export):
    model, encoder, codec, size = _editing_model(tiny_export)
    prompts = ["make the circle red", "make the square blue", "make it green"]
    text = encoder.encode(prompts)
    sources = codec.encode(torch.rand(3, 3, size, size, generator=torch.Generator().manual_seed(1)))
    embeds = PromptEmbeds(text.tokens, text.pooled, sources)
    traj = _rollout(model, encoder, codec, size, embeds, prompts)
    assert torch.equal(traj.embeds.images, sources)  # recorded with the prompts
    picked = Trajectory.cat([traj.select(torch.tensor([2])), traj.select(torch.tensor([0, 1]))])
    assert torch.equal(picked.embeds.images, sources[[2, 0, 1]])  # and kept through select and cat
    # the rewards read them as pixels, decoded by the codec that decoded the samples
    assert torch.equal(traj.sources, codec.decode(sources))
    assert torch.equal(picked.reward_metadata(3)["source_images"], traj.sources[[2, 0, 1]])
    # the evaluation's metadata follows its images' order, sample-major (sample j of prompt i at j * P + i)
    from posttrain.eval.evaluate import reward_metadata

    meta = reward_metadata(codec, embeds, 2, batch_size=2)["source_images"]
    assert torch.equal(meta, codec.decode(sources)[[0, 1, 2, 0, 1, 2]])
    with torch.no_grad():
        for t in range(STEPS):
            again = log_prob(model, traj, t).log_prob
            assert (again - traj.log_probs[:, t]).abs().max().item() <= 1e-5, t
        swapped = traj.select(torch.arange(3))
        swapped.embeds = PromptEmbeds(text.tokens, text.pooled, sources.flip(0))
        other = log_prob(model, swapped, 1).log_prob
    # the recomputation is conditioned on the trajectory's image: another image is another policy's log-prob
    assert (other - traj.log_probs[:, 1]).abs().max().item() > 1e-3
    # the same noise and text with other sources draw other samples: the rollout read the images too
    assert not torch.allclose(_rollout(model, encoder, codec, size, swapped.embeds, prompts).latents, traj.latents)


def test_both_cfg_branches_see_the_image_and_a_text_only_family_refuses_it(tiny_export):
    from pretrain.guidance import cfg_branches, drop_condition

    model, encoder, codec, size = _editing_model(tiny_export)
    text, null = encoder.encode(["make it red"]), encoder.encode([""])
    a, b = (codec.encode(torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(s))) for s in (1, 2))
    x, sigma = torch.randn(1, *codec.latent_shape(size, size)), torch.tensor([0.6])
    with torch.no_grad():
        _, uncond_a = cfg_branches(model, x, sigma, PromptEmbeds(text.tokens, text.pooled, a), null)
        _, uncond_b = cfg_branches(model, x, sigma, PromptEmbeds(text.tokens, text.pooled, b), null)
    assert (uncond_a - uncond_b).abs().max().item() > 1e-4  # the unconditional branch keeps the source image
    dropped = drop_condition(PromptEmbeds(text.tokens, text.pooled, a), null, torch.tensor([True]))
    assert torch.equal(dropped.images, a) and torch.equal(dropped.tokens, null.tokens)
    with pytest.raises(ValueError, match="some prompts carry conditioning images"):
        PromptEmbeds.cat([PromptEmbeds(text.tokens, text.pooled, a), text])
    with pytest.raises(ValueError, match="takes 6 input channels, got 3"):
        model(x, sigma, text)  # the editing model without its source image
    plain, *_ = load_exported(tiny_export)  # the text-to-image preset: no channels for a source image
    with pytest.raises(ValueError, match="takes 3 input channels, got 6"):
        plain(x, sigma, PromptEmbeds(text.tokens, text.pooled, a))
    from pretrain.backbone import Backbone

    class TextOnly(Backbone):  # a family whose forward has no image input (takes_images False)
        def forward(self, x, sigma, embeds):
            return self.transformer(x)

    with pytest.raises(ValueError, match="TextOnly: the prompts carry conditioning images"):
        TextOnly(torch.nn.Identity())(x, sigma, PromptEmbeds(text.tokens, text.pooled, a))
    assert torch.equal(TextOnly(torch.nn.Identity())(x, sigma, text), x)
