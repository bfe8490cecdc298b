"""open_clip's ``--accum-freq k`` vs the full-batch step: the gradients of each parameter.

Not part of ``run_all.py``: it needs PyTorch and open-clip-torch, which unsplit does not
depend on. Run it in a separate environment::

    python -m venv /tmp/oc-venv
    /tmp/oc-venv/bin/pip install torch==2.13.0 numpy
    /tmp/oc-venv/bin/pip install --no-deps open-clip-torch==3.3.0
    /tmp/oc-venv/bin/python benchmarks/open_clip_accum_check.py

It uses open_clip's own ``ClipLoss`` and ``SigLipLoss`` (``open_clip/loss.py``, loaded by
path: the package's ``__init__`` needs torchvision) and the accumulation recipe of
``open_clip_train/train.py`` (``train_one_epoch`` with ``accum_freq > 1``): the features of
the k micro-batches are cached without gradients, then each micro-batch is recomputed with
gradients, the loss of the whole batch is computed from its features and the cached
features of the others (``logit_scale``/``logit_bias`` passed directly), and ``backward``
runs once per micro-batch, the gradients adding up. Two linear towers without dropout
stand for the image and text encoders, so the only difference from the full-batch step is
the recipe. Prints, per parameter, the accumulated gradient divided by the full-batch one
(quoted in docs/coupled.md).
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import open_clip_train
import torch


def load_open_clip_loss():
    root = pathlib.Path(open_clip_train.__file__).resolve().parent.parent / "open_clip"
    spec = importlib.util.spec_from_file_location("open_clip_loss", root / "loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Towers(torch.nn.Module):
    def __init__(self, siglip: bool):
        super().__init__()
        self.image = torch.nn.Linear(12, 8)
        self.text = torch.nn.Linear(10, 8)
        self.logit_scale = torch.nn.Parameter(torch.tensor(np.log(10.0), dtype=torch.float64))
        self.logit_bias = torch.nn.Parameter(torch.tensor(-10.0)) if siglip else None

    def forward(self, images, texts):
        out = {
            "image_features": torch.nn.functional.normalize(self.image(images), dim=-1),
            "text_features": torch.nn.functional.normalize(self.text(texts), dim=-1),
            "logit_scale": self.logit_scale.exp(),
        }
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        return out


def full_batch_grads(model, loss, images, texts):
    model.zero_grad()
    loss(**model(images, texts)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def accumulated_grads(model, loss, images, texts, k: int):
    """open_clip_train.train.train_one_epoch's ``accum_freq > 1`` branch, on one batch."""
    accum_images, accum_texts = images.chunk(k), texts.chunk(k)
    accum_features = {}
    with torch.no_grad():
        for im, tx in zip(accum_images, accum_texts, strict=True):
            model_out = model(im, tx)
            for f in ("logit_scale", "logit_bias"):
                model_out.pop(f, None)
            for key, val in model_out.items():
                accum_features.setdefault(key, []).append(val)
    model.zero_grad()
    for j in range(k):
        model_out = model(accum_images[j], accum_texts[j])
        inputs_no_accum = {"logit_scale": model_out.pop("logit_scale")}
        if "logit_bias" in model_out:
            inputs_no_accum["logit_bias"] = model_out.pop("logit_bias")
        inputs = {}
        for key, accumulated in accum_features.items():
            # As train.py: this micro-batch's live features among the cached ones.
            inputs[key] = torch.cat([*accumulated[:j], model_out[key], *accumulated[j + 1 :]])
        loss(**inputs, **inputs_no_accum).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def main() -> None:
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)  # ratios to many digits
    losses = load_open_clip_loss()
    images, texts = torch.randn(16, 12), torch.randn(16, 10)
    print("| loss | k | parameter | accumulated grad / full-batch grad |")
    print("|---|---|---|---|")
    for name, loss, siglip in (
        ("ClipLoss", losses.ClipLoss(), False),
        ("SigLipLoss", losses.SigLipLoss(), True),
    ):
        model = Towers(siglip)
        full = full_batch_grads(model, loss, images, texts)
        for k in (2, 4):
            accumulated = accumulated_grads(model, loss, images, texts, k)
            for param, g in full.items():
                ratio = (accumulated[param].flatten() @ g.flatten()) / (g.flatten() @ g.flatten())
                err = (accumulated[param] - ratio * g).norm() / g.norm()
                print(f"| {name} | {k} | `{param}` | {ratio:.6f} (residual {err:.1e}) |")


if __name__ == "__main__":
    main()
