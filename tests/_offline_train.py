"""What a trainer does with an offline-RL algorithm's parts, without Lightning: for the build-and-train tests."""

from __future__ import annotations


def train(parts, batch, steps: int, check=None) -> list:
    """``steps`` steps on ``batch``: sum every loss_* term, one backward, step the due groups, update targets.
    ``check(out)``, when given, sees each step's loss output before the backward; returns the detached outputs."""
    optimizers = [(g, g.make_optimizer()) for g in parts.optimizers]
    keys = parts.loss_keys()
    history = []
    for step in range(steps):
        out = parts.loss(batch.clone())
        if check is not None:
            check(out)
        history.append(out.detach())
        total = sum(out[k] for k in keys)
        for _, opt in optimizers:
            opt.zero_grad()
        total.backward()
        for group, opt in optimizers:
            if group.due(step):
                opt.step()
        if parts.target_updater is not None:
            parts.target_updater.step()
    return history
