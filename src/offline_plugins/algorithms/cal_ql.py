"""Cal-QL: CQL whose conservative term is bounded below by the data's discounted Monte-Carlo return.

Nakamoto, Zhai, Singh, Sobol Mark, Ma, Finn, Kumar & Levine 2023, "Cal-QL: Calibrated
Offline RL Pre-Training for Efficient Online Fine-Tuning", arXiv:2303.05479. The offline
phase here; ``train --online-steps`` fine-tunes online after it
(:mod:`offline_plugins.kinds.environment.finetune`). Defaults are our
``cql``'s (Kumar et al.'s Gym settings: weight 5, 10 sampled actions, policy lr 1e-4,
critic lr 3e-4), so the two differ only by the bound; the Cal-QL paper uses weight 5 on
AntMaze and Kitchen, CORL's ``algorithms/finetune/cal_ql.py`` 10 and a policy lr of 3e-5.

The bound is the discounted return :math:`\\sum_k \\gamma^k r_{t+k}` to the episode's end at the
config's ``gamma``, computed from the stored episodes when the algorithm is built
(:func:`offline_plugins.objectives.columns.discounted_returns`, the ``mc_return`` column that the
Monte-Carlo diagnostics of every algorithm read); the dataset's own ``return_to_go`` is
undiscounted and is not used for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.algorithms.cql import CQLConfig, build_with
from offline_plugins.config import FineTuneConfig, config_field
from offline_plugins.errors import UserError
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

PAPER = ("Nakamoto, Zhai, Singh, Sobol Mark, Ma, Finn, Kumar & Levine 2023, Cal-QL: Calibrated Offline RL "
         "Pre-Training for Efficient Online Fine-Tuning, arXiv:2303.05479")


@dataclass
class CalQLConfig(FineTuneConfig, CQLConfig):
    min_q_weight: float = config_field(5.0, "weight of the conservative term (Cal-QL paper, AntMaze/Kitchen: 5; CORL: 10)")


def build(config: CalQLConfig, data: Any):
    """CQL's parts with :class:`~offline_plugins.objectives.cal_ql.CalQLLoss` and the data's discounted returns."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.objectives.cal_ql import CalQLLoss

    _glue.check_inputs(config, data, "cal-ql", "continuous")
    td = getattr(data, "td", None)
    if td is None:
        raise UserError("cal-ql: the data has no stored transitions (data.td) to compute the Monte-Carlo returns "
                        "from; load it with offline_plugins.data.load_offline_data")
    # build_with gives the loss the data's mc_return at config.gamma (_glue.mc_columns): the bound and
    # the diagnostics read the same column
    return build_with(CalQLLoss, config, data)


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "cal-ql", "CQL whose push-down on policy actions stops at the data's discounted Monte-Carlo return",
        CalQLConfig, PAPER, loss="cal_ql:CalQLLoss", build="cal_ql:build",
    ),
)
