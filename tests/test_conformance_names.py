"""A loss of ours that carries a TorchRL loss's name is that loss (a subclass keeping its contract);
one with another contract has a name of its own, so a user importing both is not misled."""

from __future__ import annotations

import torchrl.objectives
import torchrl.objectives.llm

import offline_plugins.objectives as objectives


def _torchrl_classes() -> dict:
    out = {}
    for module in (torchrl.objectives, torchrl.objectives.llm):
        for name in dir(module):
            obj = getattr(module, name)
            if isinstance(obj, type):
                out.setdefault(name, obj)
    return out


def test_every_loss_sharing_a_torchrl_name_subclasses_that_torchrl_class():
    theirs = _torchrl_classes()
    shared = sorted(set(objectives.__all__) & set(theirs))
    assert shared, "no shared names at all: the check lost its subject"
    misleading = [n for n in shared if not issubclass(getattr(objectives, n), theirs[n])]
    assert not misleading, f"these carry a TorchRL name with another contract: {misleading}"


def test_the_text_grpo_and_sft_losses_have_names_of_their_own():
    assert "GRPOLoss" not in objectives.__all__ and "SFTLoss" not in objectives.__all__
    assert objectives.TextGRPOLoss.__name__ == "TextGRPOLoss"
    assert objectives.TextSFTLoss.__name__ == "TextSFTLoss"
