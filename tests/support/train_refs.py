"""The references of the training tests, one per family (tests/support/families.py's `TrainingKit` names them):
diffusers' flow-matching loss on a batch of tokens, diffusers' own objective of a written LoRA on one image, and
the `--timesteps shift` noise levels. A batch is x0, noise (B, L, C) target tokens (row-major over `grid`
(h, w)); u (B,) float32 uniform draws; one caption (1, Lt, E) per example; references, each (B, L, C)."""

from __future__ import annotations

import math

import numpy as np
import torch
from tiny_model import SCHEDULER


def scheduler_sigmas(u: torch.Tensor):
    """diffusers' training draw: u -> (u * 1000).long() -> the scheduler's (timesteps, sigmas) there."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    idx = (u * 1000).long()
    return sched.timesteps[idx], sched.sigmas[idx]


def flux2_training_loss(transformer, x0, noise, u, ctxs, conds, grid):
    """diffusers' klein trainer loss (D-kt `main`; with references, D-ki's edit sequence: each reference's
    packed latents after the target's, at time 10 (k + 1)) through Flux2Transformer2DModel. Captions of
    different lengths cannot share a call: each example then runs alone, the loss is their mean."""
    from diffusers import Flux2KleinPipeline as P

    if len({c.shape[1] for c in ctxs}) > 1:
        one = [  # example i alone
            (x0[i : i + 1], noise[i : i + 1], u[i : i + 1], [ctxs[i]], [c[i : i + 1] for c in conds])
            for i in range(len(ctxs))
        ]
        return torch.stack([flux2_training_loss(transformer, *ex, grid) for ex in one]).mean()
    h, w = grid
    nchw = lambda t: t.transpose(1, 2).reshape(t.shape[0], -1, h, w)  # noqa: E731  (B, L, C) -> (B, C, h, w)
    x0, noise, ctx = nchw(x0), nchw(noise), torch.cat(ctxs, 0)
    timesteps, sigmas = scheduler_sigmas(u)
    sigmas = sigmas.to(x0.dtype).view(-1, 1, 1, 1)  # get_sigmas(..., dtype=model_input.dtype)
    ids = P._prepare_latent_ids(x0)
    packed = P._pack_latents((1.0 - sigmas) * x0 + sigmas * noise)
    hidden, img_ids = packed, ids
    if conds:
        cond = [nchw(c) for c in conds]
        cond_ids = P._prepare_image_ids([c[0:1] for c in cond]).expand(x0.shape[0], -1, -1)
        hidden = torch.cat([packed] + [P._pack_latents(c) for c in cond], 1)
        img_ids = torch.cat([ids, cond_ids], 1)
    pred = transformer(
        hidden_states=hidden,
        timestep=timesteps / 1000,
        guidance=None,
        encoder_hidden_states=ctx,
        txt_ids=P._prepare_text_ids(ctx),
        img_ids=img_ids,
        return_dict=False,
    )[0]
    pred = P._unpack_latents_with_ids(pred[:, : packed.size(1)], ids)
    target = noise - x0
    return torch.mean(((pred.float() - target.float()) ** 2).reshape(x0.shape[0], -1), 1).mean()


def flux3_training_loss(transformer, x0, noise, u, ctxs, conds, grid):
    """The same objective through diffusers' FLUX 3 call as its modular pipeline makes it (diffusers has no FLUX 3
    trainer): the image at `timestep` sigma, the references as `image_cond_hidden_states` with
    `_prepare_image_ids(..., l_coord=-(k + 1))`, each caption with its own `txt_ids`; each example runs alone."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids

    h, w = grid
    sigma = scheduler_sigmas(u)[1]
    losses = []
    for i, ctx in enumerate(ctxs):
        s = sigma[i : i + 1].view(-1, 1, 1)
        xt = (1.0 - s) * x0[i : i + 1] + s * noise[i : i + 1]
        kwargs = {}
        if conds:
            kwargs["image_cond_hidden_states"] = torch.cat([c[i : i + 1] for c in conds], 1)
            kwargs["image_cond_ids"] = torch.cat(
                [_prepare_image_ids(h, w, 0.5, l_coord=-(1 + k)) for k in range(len(conds))], 0
            )
        pred = transformer(
            hidden_states=xt,
            encoder_hidden_states=ctx,
            timestep=sigma[i : i + 1],
            img_ids=_prepare_image_ids(h, w, 0.5),
            txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(ctx),
            return_dict=False,
            **kwargs,
        )[0]
        target = noise[i : i + 1] - x0[i : i + 1]
        losses.append(torch.mean((pred.float() - target.float()) ** 2))
    return torch.stack(losses).mean()


def vae_latents(vae, patchify, image, size=(64, 64)) -> torch.Tensor:
    """diffusers' trainer latents (1, C, h, w) of an image file resized and cropped to `size` = (W, H) as ours
    are: its VAE's mode, patchified (`patchify`: the pipeline's own), normalized by its batch-norm statistics."""
    from flux_klein_mlx.train.data.dataset import load_pixels

    px = torch.from_numpy(load_pixels(image, size)).permute(2, 0, 1)[None]
    z = patchify(vae.encode(px).latent_dist.mode())
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return (z - vae.bn.running_mean.view(1, -1, 1, 1)) / std


def flux2_lora_objective(snapshot, image, caption: str, lora) -> tuple[float, float]:
    """diffusers' own objective (D-kt's loss) on one image over 12 fixed (noise, scheduler index) draws, with the
    Base model and with the LoRA file loaded by `load_lora_weights`: (before, after)."""
    from diffusers import Flux2KleinPipeline as P
    from refs import diffusers_pipeline, diffusers_pipeline_for_loras, diffusers_prompt_embeds

    pipe = diffusers_pipeline_for_loras(snapshot, distilled=False)
    with torch.no_grad():
        x0 = vae_latents(pipe.vae, P._patchify_latents, image)
        ctx = diffusers_prompt_embeds(diffusers_pipeline(snapshot, "plain", distilled=False), caption)
        g = torch.Generator().manual_seed(0)
        draws = [(torch.randn(x0.shape, generator=g), torch.randint(0, 1000, (1,), generator=g)) for _ in range(12)]
        tokens = lambda t: t.flatten(2).transpose(1, 2)  # noqa: E731  (1, C, h, w) -> (1, L, C)
        grid = x0.shape[2:]
        # the draws are scheduler indices i: the loss takes uniform draws u, and (u * 1000).long() of the middle of
        # [i, i + 1) / 1000 is i in float32 (i / 1000 itself may come back as i - 1)

        def objective():
            losses = [
                flux2_training_loss(pipe.transformer, tokens(x0), tokens(e), (i + 0.5) / 1000, [ctx], [], grid)
                for e, i in draws
            ]
            return float(np.mean([x.item() for x in losses]))

        before = objective()
        pipe.load_lora_weights(lora, adapter_name="short")
        return before, objective()


def flux3_lora_objective(snapshot, image, caption: str, lora) -> tuple[float, float]:
    """The flow-matching objective in diffusers on one image over 12 fixed (noise, sigma) draws: its VAE latents
    (as its reference step encodes them), its prompt embeddings, its Flux3Transformer2DModel, without and with
    the LoRA file: (before, after)."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep, Flux3VaeEncoderStep
    from flux3_refs import flux3_pipeline

    pipe = flux3_pipeline(snapshot)
    with torch.no_grad():
        x0 = vae_latents(pipe.vae, Flux3VaeEncoderStep._patchify_latents, image).flatten(2).transpose(1, 2)
        ctx = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(pipe.text_encoder, pipe.tokenizer, caption)
        ids = dict(img_ids=_prepare_image_ids(4, 4, 0.5), txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(ctx))
        g = torch.Generator().manual_seed(0)
        draws = [(torch.randn(x0.shape, generator=g), torch.rand(1, generator=g)) for _ in range(12)]

        def objective():
            losses = []
            for eps, s in draws:
                xt = (1 - s) * x0 + s * eps
                v = pipe.transformer(xt, ctx, s, return_dict=False, **ids)[0]
                losses.append(torch.mean((v - (eps - x0)) ** 2).item())
            return float(np.mean(losses))

        before = objective()
        pipe.load_lora_weights(str(lora), adapter_name="short")
        try:
            return before, objective()
        finally:
            pipe.unload_lora_weights()


def flux2_shift_mu(tokens: int) -> float:
    """musubi's flux2_shift (trainer_base.py): mu for the token count of the patchified latents."""
    m = (1.15 - 0.5) / (4096 - 256)
    return m * tokens + (0.5 - m * 256)


def flux2_shift_sigmas(n: torch.Tensor, tokens: int) -> np.ndarray:
    """musubi's flux2_shift of a logit-normal draw: sigmoid(n) time-shifted by exp(mu(tokens))."""
    t, e = torch.sigmoid(n * 1.0), math.exp(flux2_shift_mu(tokens))
    return ((t * e) / (1 + (e - 1) * t)).numpy()


def flux3_shift_sigmas(n: torch.Tensor, tokens: int) -> np.ndarray:
    """diffusers' FLUX 3 scheduler (`Flux3SetTimestepsStep`'s constant shift, the same at every size) at
    t = sigmoid(n)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3SetTimestepsStep

    sched = FlowMatchEulerDiscreteScheduler(shift=Flux3SetTimestepsStep().shift)
    sched.set_timesteps(sigmas=list(torch.sigmoid(n).numpy().astype(np.float64)))
    return sched.sigmas[:-1].numpy()
