"""Trajectory Transformer loss: weighted next-token cross-entropy over discretised transitions.

Janner, Li & Levine 2021, "Offline Reinforcement Learning as One Big Sequence
Modeling Problem", arXiv:2106.02039. TorchRL has no Trajectory Transformer.

>>> import torch
>>> from tensordict import TensorDict
>>> from tensordict.nn import TensorDictModule
>>> from offline_plugins.modules.sequence.discretizer import Discretizer
>>> from offline_plugins.modules.sequence.trajectory_transformer import TrajectoryTransformerNet
>>> batch = TensorDict({"observation": torch.randn(8, 2), "action": torch.randn(8, 1),
...     "discounted_return_to_go": torch.randn(8, 1),
...     "next": {"reward": torch.randn(8, 1), "terminated": torch.zeros(8, 1, dtype=torch.bool)}}, [8])
>>> disc = Discretizer.fit(torch.randn(100, 5), bins=10)
>>> net = TrajectoryTransformerNet(5, 10, embed_dim=16, num_layers=1, num_heads=1, max_transitions=4)
>>> loss = TrajectoryTransformerLoss(TensorDictModule(net, ["tokens"], ["logits"]), disc, window=4)
>>> out = loss(batch)  # two windows of 4 transitions, flat as SliceSampler gives them
>>> out["loss_model"].shape, sorted(k for k in out.keys() if not k.startswith("loss"))
(torch.Size([]), ['action_ce', 'observation_ce', 'reward_ce', 'token_accuracy', 'value_ce'])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase, TensorDictParams
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torchrl.objectives import LossModule

from offline_plugins.modules.sequence.decision_transformer import windows
from offline_plugins.modules.sequence.discretizer import Discretizer
from offline_plugins.objectives.common import check_batch_keys, check_range
from offline_plugins.objectives.sequence.common import DiscretizationError

__all__ = ["TrajectoryTransformerLoss"]


class TrajectoryTransformerLoss(LossModule):
    """Next-token cross-entropy of a GPT over ``(s, a, r, V)`` tokens, action tokens up-weighted.

    A window of ``K`` transitions is discretised per dimension into ``K * D`` tokens
    (``D = obs_dim + act_dim + 2``); the model reads tokens ``0..KD-2`` and is scored
    on ``1..KD-1``, each target weighted by its kind (the reference weights actions 5).

    Args:
        model_network: a tensordict module reading ``"tokens"`` ``[B, T]`` and writing
            ``"logits"`` ``[B, T, bins]``
            (:class:`~offline_plugins.modules.sequence.trajectory_transformer.TrajectoryTransformerNet`).
        discretizer: the fitted per-dimension :class:`~offline_plugins.modules.sequence.discretizer.Discretizer`
            of ``[observation, action, reward, value]``.

    Keyword Args:
        window: transitions per window ``K`` (flat ``[B*K]`` batches are reshaped).
        action_weight, reward_weight, value_weight: cross-entropy weights of those
            tokens; observation tokens weigh 1 (reference: 5, 1, 1).
        termination_penalty: added to the reward of terminal steps (reference: -100
            for locomotion; the value column must have been computed with it too).
    """

    @dataclass
    class _AcceptedKeys:
        """Keys the loss reads; rename them with ``set_keys``.

        Attributes:
            observation: Defaults to ``"observation"``.
            action: Defaults to ``"action"``.
            reward: Defaults to ``("next", "reward")``.
            terminated: Defaults to ``("next", "terminated")``.
            value: the discounted return-to-go. Defaults to ``"discounted_return_to_go"``.
        """

        observation: NestedKey = "observation"
        action: NestedKey = "action"
        reward: NestedKey = ("next", "reward")
        terminated: NestedKey = ("next", "terminated")
        value: NestedKey = "discounted_return_to_go"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    model_network: TensorDictModule
    model_network_params: TensorDictParams
    target_model_network_params: TensorDictParams

    def __init__(
        self,
        model_network: TensorDictModule,
        discretizer: Discretizer,
        *,
        window: int,
        action_weight: float = 5.0,
        reward_weight: float = 1.0,
        value_weight: float = 1.0,
        termination_penalty: float = 0.0,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        for field, v in (("action_weight", action_weight), ("reward_weight", reward_weight), ("value_weight", value_weight)):
            check_range(name, field, v, 0.0, None, low_inclusive=True)
        check_range(name, "window", window, 1, None, low_inclusive=True)
        self.convert_to_functional(model_network, "model_network", create_target_params=False)
        self.discretizer = discretizer
        self.window = int(window)
        self.register_buffer("termination_penalty", torch.tensor(float(termination_penalty)))
        self._weights = (float(action_weight), float(reward_weight), float(value_weight))
        self._dim_weights: dict = {}

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass

    @property
    def in_keys(self):
        k = self.tensor_keys
        return [k.observation, k.action, k.reward, k.terminated, k.value]

    @property
    def out_keys(self):
        return ["loss_model", "observation_ce", "action_ce", "reward_ce", "value_ce", "token_accuracy"]

    def transitions(self, tensordict: TensorDictBase) -> torch.Tensor:
        """``[B, K, D]`` floats ``(s, a, r, V)`` of a window batch (flat ``[B*K]`` or ``[B, K]``)."""
        check_batch_keys(tensordict, self.in_keys, type(self).__name__)
        w = windows(tensordict, self.window, type(self).__name__)
        k = self.tensor_keys
        reward = w.get(k.reward) + self.termination_penalty * w.get(k.terminated).to(w.get(k.reward).dtype)
        x = torch.cat([w.get(k.observation), w.get(k.action), reward, w.get(k.value)], -1)
        if x.shape[-1] != self.discretizer.dim:
            raise DiscretizationError(
                f"{type(self).__name__}: transitions have {x.shape[-1]} dimensions (observation + action + reward + "
                f"value) but the discretizer was fitted on {self.discretizer.dim}; fit it on the same data"
            )
        return x

    def tokens(self, tensordict: TensorDictBase) -> torch.Tensor:
        """``[B, K * D]`` int64 tokens of a window batch."""
        x = self.transitions(tensordict)
        return self.discretizer.encode(x).reshape(x.shape[0], -1)

    def _target_weights(self, D: int, n_act: int, device) -> torch.Tensor:
        key = (D, n_act, str(device))
        if key not in self._dim_weights:
            act_w, rew_w, val_w = self._weights
            w = torch.ones(D, device=device)
            w[D - 2 - n_act : D - 2] = act_w
            w[D - 2] = rew_w
            w[D - 1] = val_w
            self._dim_weights[key] = w
        return self._dim_weights[key]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        x = self.transitions(tensordict)
        B, K, D = x.shape
        n_act = tensordict.get(self.tensor_keys.action).shape[-1]
        tokens = self.discretizer.encode(x).reshape(B, K * D)
        inp = TensorDict({"tokens": tokens[:, :-1]}, [B])
        with self.model_network_params.to_module(self.model_network, preserve_module_state=False):
            logits = self.model_network(inp).get("logits")
        target = tokens[:, 1:]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view(B, -1)
        dims = torch.arange(1, K * D, device=tokens.device) % D
        loss = (ce * self._target_weights(D, n_act, tokens.device)[dims]).mean()
        with torch.no_grad():
            # mean cross-entropy per token kind, by masks rather than boolean indexing
            # (which would wait for the device)
            n_obs = D - 2 - n_act
            kind = torch.where(dims < n_obs, 0, torch.where(dims < D - 2, 1, torch.where(dims == D - 2, 2, 3)))
            masks = (kind == torch.arange(4, device=kind.device).unsqueeze(-1)).to(ce.dtype)
            per_kind = (masks * ce.mean(0)).sum(-1) / masks.sum(-1).clamp_min(1)
            acc = (logits.argmax(-1) == target).float().mean()
        return TensorDict(
            {
                "loss_model": loss,
                "observation_ce": per_kind[0],
                "action_ce": per_kind[1],
                "reward_ce": per_kind[2],
                "value_ce": per_kind[3],
                "token_accuracy": acc,
            },
            [],
        )
