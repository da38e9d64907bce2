"""Per-transition columns a loss reads that the data layer does not store, looked up by index.

ReBRAC's critic penalty reads the data's next action ``("next", "action")``, and Cal-QL's
bound reads the Monte-Carlo return discounted at the loss's gamma, ``mc_return``, as do the
Monte-Carlo diagnostics (``mc_return_mean``, ``q_data_minus_mc``) of every loss with
``mc_diagnostics=True``. ``OfflineData`` stores neither (its ``return_to_go`` is
undiscounted). Both follow from the stored episodes, so :func:`next_actions` and
:func:`discounted_returns` compute them once, and a
:class:`DatasetColumns` hands them to a batch by the storage ``index`` that TorchRL's replay
buffer writes into every sample. A batch that already carries a column keeps its own, so
a user's own pipeline (or a keyword call) passes the keys directly.

>>> import torch
>>> from tensordict import TensorDict
>>> td = TensorDict({
...     "action": torch.tensor([[0.1], [0.2], [0.3], [0.4]]),
...     "episode": torch.tensor([0, 0, 0, 1]),
...     ("next", "reward"): torch.tensor([[1.0], [1.0], [1.0], [5.0]]),
...     ("next", "done"): torch.tensor([[False], [False], [True], [True]]),
...     ("next", "terminated"): torch.tensor([[False], [False], [False], [True]]),
... }, [4])
>>> discounted_returns(td, gamma=0.5).squeeze(-1).tolist()  # 1 + .5 (1 + .5 * 1), 1 + .5, 1 | 5
[1.75, 1.5, 1.0, 5.0]
>>> next_actions(td).squeeze(-1).tolist()  # nan: the episode ended, no next action
[0.20000000298023224, 0.30000001192092896, nan, nan]
>>> columns = DatasetColumns({"mc_return": discounted_returns(td, gamma=0.5)})
>>> batch = columns.fill(TensorDict({"index": torch.tensor([2, 0])}, [2]))
>>> batch["mc_return"].squeeze(-1).tolist()
[1.0, 1.75]
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey

from offline_plugins.objectives.common import MissingBatchKeyError

__all__ = ["DatasetColumns", "next_actions", "discounted_returns"]


def _episode_ends(td: TensorDictBase) -> np.ndarray:
    """Where an episode stops in the stored order: done, the episode id changes, or the data ends."""
    done = td.get(("next", "done")).reshape(-1).cpu().numpy().astype(bool)
    ends = done.copy()
    episode = td.get("episode", None)
    if episode is not None:
        ep = episode.reshape(-1).cpu().numpy()
        ends[:-1] |= ep[1:] != ep[:-1]
    ends[-1] = True
    return ends


def discounted_returns(td: TensorDictBase, gamma: float) -> torch.Tensor:
    r"""The discounted Monte-Carlo return of every stored transition, ``[N, 1]``.

    :math:`G_t = r_t + \gamma (1 - \mathrm{terminated}_t) G_{t+1}` backwards within each
    episode, with :math:`G = 0` after its last step, as Cal-QL's ``get_return_to_go``
    (Nakamoto et al. 2023; CORL ``algorithms/finetune/cal_ql.py``) computes it. After a
    truncation the unseen tail counts 0, so with negative rewards (Pendulum) the last steps'
    returns lie above the true value; Cal-QL uses them as they are.
    ``td`` is the stored data in episode order (``OfflineData.td``), rewards as trained on.
    """
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"discounted_returns: gamma={gamma} is outside [0, 1]")
    reward = td.get(("next", "reward")).reshape(-1).double().cpu().numpy()
    term = td.get(("next", "terminated")).reshape(-1).cpu().numpy().astype(bool)
    ends = _episode_ends(td)
    out = np.empty_like(reward)
    running = 0.0
    for i in range(reward.shape[0] - 1, -1, -1):
        if ends[i] or term[i]:
            running = 0.0
        running = reward[i] + gamma * running
        out[i] = running
    return torch.from_numpy(out).to(torch.float32).unsqueeze(-1).to(td.device)


def next_actions(td: TensorDictBase) -> torch.Tensor:
    """The data's action at the next step of every stored transition, shaped like ``action``.

    NaN where the episode ends (done, or the last stored step), since the data has no next
    action there; a loss reading it treats those rows as having no penalty.
    """
    action = td.get("action").to(torch.float32)
    out = torch.full_like(action, float("nan"))
    ends = torch.from_numpy(_episode_ends(td)).to(action.device)
    out[:-1] = action[1:]
    out[ends] = float("nan")
    return out


class DatasetColumns(torch.nn.Module):
    """Columns indexed like the replay buffer's storage, filled into batches by their ``index``.

    Args:
        columns: ``{key: tensor [N, ...]}``, one row per stored transition. They follow
            ``.to()`` (the module's ``_apply``) but are not buffers: they stay out of
            checkpoints (``build`` recomputes them from the data) and DDP does not broadcast
            them each step (every rank builds the same columns from the same data).

    Keyword Args:
        index_key (NestedKey): where a batch carries its storage indices. Defaults to
            ``"index"`` (what TorchRL's ``TensorDictReplayBuffer.sample`` writes).
        makers (Mapping[NestedKey, Callable]): how each column follows from stored episodes,
            ``make(td) -> tensor``, so :meth:`compute` can make them for new transitions (the
            online phase of fine-tuning, :mod:`offline_plugins.kinds.environment.finetune`). Made by
            :meth:`of`.
    """

    def __init__(self, columns: Mapping[NestedKey, torch.Tensor], *, index_key: NestedKey = "index",
                 makers: Optional[Mapping[NestedKey, Callable[[TensorDictBase], torch.Tensor]]] = None) -> None:
        super().__init__()
        self.keys = list(columns)
        self.index_key = index_key
        self.makers = dict(makers or {})
        self.values = list(columns.values())
        self._checked = False  # the batches' index against the columns' length: once, not every step

    def _apply(self, fn, recurse: bool = True):
        self.values = [fn(v) for v in self.values]
        return super()._apply(fn, recurse)

    @classmethod
    def of(cls, td: TensorDictBase, makers: Mapping[NestedKey, Callable[[TensorDictBase], torch.Tensor]],
           **kwargs) -> "DatasetColumns":
        """The columns ``makers`` make from the stored episodes ``td``, keeping the makers.

        >>> td = TensorDict({"action": torch.tensor([[1.0], [2.0]]), ("next", "reward"): torch.ones(2, 1),
        ...                  ("next", "done"): torch.tensor([[False], [True]]),
        ...                  ("next", "terminated"): torch.tensor([[False], [True]])}, [2])
        >>> DatasetColumns.of(td, {("next", "action"): next_actions}).compute(td)[("next", "action")].squeeze(-1)
        tensor([2., nan])
        """
        return cls({key: make(td) for key, make in makers.items()}, makers=makers, **kwargs)

    def compute(self, td: TensorDictBase) -> dict:
        """Every column for the new episodes ``td`` (in episode order), by the makers given to :meth:`of`."""
        missing = [k for k in self.keys if k not in self.makers]
        if missing:
            raise ValueError(f"DatasetColumns: no maker for {missing}; build the columns with DatasetColumns.of(td, "
                             "makers) to compute them for new transitions")
        return {key: self.makers[key](td) for key in self.keys}

    def fill(self, tensordict: TensorDictBase) -> TensorDictBase:
        """``tensordict`` with every column it lacks set from its ``index``; returned as given
        (no index, or nothing missing). Raises when an index of the first batch filled is past the
        columns' end (checked once: a check every step would sync the host with the device)."""
        missing = [k for k in self.keys if tensordict.get(k, None) is None]
        index = tensordict.get(self.index_key, None) if missing else None
        if index is None:
            return tensordict
        n = self.values[0].shape[0]
        if not self._checked and index.numel():  # one host sync, on the first batch
            if int(index.max()) >= n:
                raise MissingBatchKeyError(
                    f"DatasetColumns: the batch's {self.index_key!r} reaches {int(index.max())} but the columns "
                    f"have {n} rows; build the algorithm on the dataset the batches are sampled from"
                )
            self._checked = True
        for key, column in zip(self.keys, self.values):
            if key in missing:
                value = column[index.to(torch.long)]
                tensordict.set(key, value.to(tensordict.device) if tensordict.device is not None else value)
        return tensordict
