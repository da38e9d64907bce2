"""Supervised fine-tuning of a model in place with the ``sft`` algorithm: how the built-in task's
reference is made.

The data layer makes references when it loads the built-in text task (the SFT reference the
preference and the online results start from) but does not import the shell; the data kinds
pass :func:`supervised_finetune` to it (``finetune=``).
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any, Sequence

import lightning
import torch

from offline_plugins.algorithms.online import SFTConfig, build_sft
from offline_plugins.lightning.callbacks import StepProgressBar
from offline_plugins.lightning.data import ReplayDataModule
from offline_plugins.lightning.guards import quiet_lightning
from offline_plugins.lightning.module import AlgorithmModule
from offline_plugins.text.data.preference import tokenize_completions
from offline_plugins.text.data.rollouts import CompletionData

__all__ = ["supervised_finetune"]


def supervised_finetune(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[dict],
    *,
    steps: int = 200,
    batch_size: int = 32,
    lr: float = 3e-3,
    max_length: int = 32,
    seed: int = 0,
    progress: bool = False,
    title: str = "sft",
) -> list[float]:
    """Train ``model`` in place with the ``sft`` algorithm on the completions; returns the loss curve.

    The SFT step of RLHF (seeds, 5.6.3): its result is the reference model. The rows become a
    :class:`~offline_plugins.text.data.rollouts.CompletionData`, :func:`~offline_plugins.algorithms.online.build_sft`
    makes the parts (``TextSFTLoss``, Adam at ``lr``, gradients clipped at norm 1) and the training
    shell (:class:`~offline_plugins.lightning.module.AlgorithmModule` under a Lightning ``Trainer``,
    batches from the rows' replay buffer seeded by ``seed``) takes ``steps`` steps; the trained
    weights are then copied into ``model``. With ``progress`` a bar titled ``title`` counts the steps.
    """
    td, _ = tokenize_completions(rows, tokenizer, max_length=max_length)
    data = CompletionData(td, [], model, tokenizer, dataset_id="rows", model="given", max_new_tokens=max_length,
                          from_scratch=False)
    config = SFTConfig(lr=float(lr), batch_size=int(batch_size), max_length=int(max_length))
    parts = build_sft(config, data)
    module = AlgorithmModule(parts, algorithm="sft", dataset="rows", seed=seed, steps_per_call=8)
    losses: list[torch.Tensor] = []

    class _Curve(lightning.Callback):
        def on_gradient_step(self, trainer, pl_module, terms) -> None:
            losses.append(terms[0].detach())

    device = next(model.parameters()).device
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(), quiet_lightning():
        # a fit of a few hundred steps: no checkpoints, no logger; Lightning's notes on that are noise here
        warnings.filterwarnings("ignore", module="lightning")
        trainer = lightning.Trainer(max_steps=int(steps), logger=False, enable_checkpointing=False,
                                    enable_model_summary=False, enable_progress_bar=bool(progress),
                                    accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                                    default_root_dir=root,
                                    callbacks=[_Curve()] + ([StepProgressBar(title=title)] if progress else []))
        trainer.fit(module, datamodule=ReplayDataModule(data, batch_size=int(batch_size), seed=seed))
    with torch.no_grad():
        model.load_state_dict(parts.model.state_dict())
    model.eval()
    return [float(x) for x in torch.stack(losses).cpu()] if losses else []
