"""The built-in judges (``offline-plugins list``, "judges"), named by import path so listing imports no torch.

``rubric``: :class:`~offline_plugins.eval.judge.RubricJudge` with its defaults, the built-in untrained
tiny model; a ``save_pretrained`` folder given to ``--judge`` makes a rubric judge of that model.
"""

from __future__ import annotations

from offline_plugins.plugins.hookspecs import hookimpl
from offline_plugins.plugins.registry import JudgeSpec

JUDGES = (
    JudgeSpec("rubric", "a causal LM asked which response better follows written principles, in both display "
              "orders (constitutional AI); the built-in untrained tiny model, or --judge FOLDER for a trained one",
              "offline_plugins.eval.judge:RubricJudge"),
)


@hookimpl
def offline_plugins_register_judges(registry):
    for spec in JUDGES:
        registry.add(spec)
