"""BCQ, continuous and discrete, as TorchRL ``LossModule`` s (TorchRL has neither).

Continuous: Fujimoto, Meger & Precup 2019, "Off-Policy Deep Reinforcement Learning
without Exploration", arXiv:1812.02900. Discrete: Fujimoto, Conti, Ghavamzadeh &
Pineau 2019, "Benchmarking Batch Deep Reinforcement Learning Algorithms",
arXiv:1910.01708.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase, TensorDictParams
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from tensordict.utils import NestedKey
from torchrl.objectives.common import LossModule
from torchrl.objectives.utils import ValueEstimators, _vmap_func, distance_loss

from offline_plugins.objectives.columns import DatasetColumns
from offline_plugins.objectives.common import TD0TransitionLoss, TransitionKeys, check_range

__all__ = ["BCQLoss", "BCQPolicy", "DiscreteBCQLoss", "DiscreteBCQPolicy", "bcq_backup", "bcq_allowed_actions"]


def bcq_backup(q_candidates: torch.Tensor, lmbda: float | torch.Tensor) -> torch.Tensor:
    r"""BCQ's soft clipped double-Q over sampled candidates.

    ``q_candidates`` has shape ``[n_critics, *batch, n_candidates]``; returns
    :math:`\max_j [\lambda \min_i Q_i(s', a_j) + (1 - \lambda) \max_i Q_i(s', a_j)]`, shape ``batch``.

    >>> q = torch.tensor([[[1.0, 5.0]], [[3.0, 2.0]]])  # 2 critics, 1 state, 2 candidates
    >>> bcq_backup(q, 0.75)
    tensor([2.7500])
    """
    mixed = lmbda * q_candidates.min(0).values + (1 - lmbda) * q_candidates.max(0).values
    return mixed.max(-1).values


class BCQLoss(TD0TransitionLoss, LossModule):
    r"""Batch-Constrained deep Q-learning (Fujimoto et al. 2019, arXiv:1812.02900).

    A conditional VAE :math:`G_\omega(a|s)` models the behaviour policy; a perturbation
    network :math:`\xi_\phi(s, a) \in [-\Phi\,\text{max\_action}, \Phi\,\text{max\_action}]`
    nudges its samples; twin critics back up only through those in-data candidates:

    .. math::
        L_{VAE} = E\|a - \hat a\|^2 + w_{KL}\, D_{KL}(N(\mu, \sigma) \| N(0, 1)) \\
        y = r + \gamma (1 - d) \max_{j \le n} [\lambda \min_i \bar Q_i(s', \tilde a_j)
            + (1 - \lambda) \max_i \bar Q_i(s', \tilde a_j)],\quad
            \tilde a_j = \bar\xi(s', a_j),\ a_j \sim G(s') \\
        L_Q = \sum_i E(Q_i(s, a) - y)^2,\qquad L_\xi = -E[Q_1(s, \xi(s, a)),\ a \sim G(s)]

    Args:
        actor_network: the perturbation model, reading ``observation`` and ``action``, writing
            ``perturbed_action`` (:func:`~offline_plugins.modules.networks.make_perturbation`).
            It has a target copy.
        qvalue_network: ``Q(s, a)`` writing ``state_action_value``; ``num_qvalue_nets`` copies
            with targets.
        vae_network: a ``TensorDictModule`` around a module with ``forward(observation, action)
            -> (reconstruction, mean, std)`` and ``decode(observation)``
            (:func:`~offline_plugins.modules.networks.make_vae`).

    Keyword Args:
        lmbda (float): :math:`\lambda` in [0, 1], weight of the critics' minimum. Defaults to 0.75.
        num_samples (int): candidates :math:`n` per next state. Defaults to 10.
        kl_weight (float): :math:`w_{KL}`. Defaults to 0.5 (the paper's code).
        num_qvalue_nets (int): critics. Defaults to 2.
        loss_function (str): critic regression loss. Defaults to ``"l2"``.
        diagnostics (bool): add ``q_data_mean``, ``mc_return_mean``/``q_data_minus_mc`` (when the
            batch carries ``mc_return``, the data's Monte-Carlo return discounted at the loss's
            gamma), ``vae_recon``, ``vae_kl``, ``perturbation_abs_mean``. Defaults to True.
        columns (DatasetColumns): fills the columns it holds (``mc_return``) into batches that
            lack them, by their storage ``index`` (:mod:`offline_plugins.objectives.columns`; the
            ``bcq`` algorithm passes one at its ``gamma``). Defaults to None.

    Gradients: ``loss_vae`` reaches only the VAE, ``loss_qvalue`` only the critics,
    ``loss_actor`` only the perturbation model, so one backward of their sum is safe.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from offline_plugins.objectives.common import random_transitions
        >>> from torchrl.data import Bounded
        >>> from offline_plugins.modules.networks import make_perturbation, make_qvalue, make_vae
        >>> spec = Bounded(-torch.ones(2), torch.ones(2), (2,))
        >>> loss = BCQLoss(make_perturbation(3, spec, (8,)), make_qvalue(3, 2, (8,)), make_vae(3, spec, (8,)))
        >>> loss.make_value_estimator(gamma=0.99)
        >>> batch = random_transitions(spec.rand((4,)), obs_dim=3)
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_actor', 'loss_qvalue', 'loss_vae']
        >>> BCQPolicy(loss, num_samples=5)(TensorDict({"observation": torch.randn(4, 3)}, [4]))["action"].shape
        torch.Size([4, 2])
    """

    @dataclass
    class _AcceptedKeys(TransitionKeys):
        """Keys the loss reads and writes: those of
        :class:`~offline_plugins.objectives.common.TransitionKeys`, and

        Attributes:
            observation (NestedKey): observation the VAE decodes from. Defaults to ``"observation"``.
            perturbed_action (NestedKey): what the actor writes. Defaults to ``"perturbed_action"``.
            state_action_value (NestedKey): what the critic writes. Defaults to ``"state_action_value"``.
        """

        observation: NestedKey = "observation"
        perturbed_action: NestedKey = "perturbed_action"
        state_action_value: NestedKey = "state_action_value"

    tensor_keys: _AcceptedKeys
    default_keys = _AcceptedKeys
    default_value_estimator = ValueEstimators.TD0
    out_keys = ["loss_actor", "loss_qvalue", "loss_vae"]

    actor_network: TensorDictModule
    qvalue_network: TensorDictModule
    vae_network: TensorDictModule
    actor_network_params: TensorDictParams
    target_actor_network_params: TensorDictParams
    qvalue_network_params: TensorDictParams
    target_qvalue_network_params: TensorDictParams
    vae_network_params: TensorDictParams
    target_vae_network_params: TensorDictParams

    def __init__(
        self,
        actor_network: TensorDictModule,
        qvalue_network: TensorDictModule,
        vae_network: TensorDictModule,
        *,
        lmbda: float = 0.75,
        num_samples: int = 10,
        kl_weight: float = 0.5,
        num_qvalue_nets: int = 2,
        loss_function: str = "l2",
        diagnostics: bool = True,
        columns: Optional[DatasetColumns] = None,
    ) -> None:
        check_range("BCQLoss", "lmbda", lmbda, 0.0, 1.0, low_inclusive=True, high_inclusive=True)
        check_range("BCQLoss", "num_samples", num_samples, 1, None, low_inclusive=True)
        check_range("BCQLoss", "kl_weight", kl_weight, 0.0, None, low_inclusive=True)
        super().__init__()
        self.convert_to_functional(actor_network, "actor_network", create_target_params=True)
        self.convert_to_functional(qvalue_network, "qvalue_network", num_qvalue_nets, create_target_params=True)
        self.convert_to_functional(vae_network, "vae_network", create_target_params=False)
        self.num_qvalue_nets = num_qvalue_nets
        self.num_samples = int(num_samples)
        self.loss_function = loss_function
        self.diagnostics = diagnostics
        self._set_columns(columns)
        self.register_buffer("lmbda", torch.tensor(float(lmbda)))
        self.register_buffer("kl_weight", torch.tensor(float(kl_weight)))
        self._vmap_qvalue = _vmap_func(self.qvalue_network, (None, 0), randomness=self.vmap_randomness)

    # -- pieces -----------------------------------------------------------------------------
    def _decode(self, observation: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        with self.vae_network_params.detach().to_module(self.vae_network, preserve_module_state=False):
            return self.vae_network.module.decode(observation, z)

    def _perturb(self, observation: torch.Tensor, action: torch.Tensor, params) -> torch.Tensor:
        keys = self.tensor_keys
        td = TensorDict({keys.observation: observation, keys.action: action}, observation.shape[:-1])
        with params.to_module(self.actor_network, preserve_module_state=False):
            return self.actor_network(td).get(keys.perturbed_action)

    def _q(self, observation: torch.Tensor, action: torch.Tensor, params) -> torch.Tensor:
        """Every critic's ``Q(s, a)``, shape ``[n_critics, *batch]``."""
        keys = self.tensor_keys
        td = TensorDict({keys.observation: observation, keys.action: action}, observation.shape[:-1])
        return self._vmap_qvalue(td, params).get(keys.state_action_value).squeeze(-1)

    @torch.no_grad()
    def candidate_q(self, observation: torch.Tensor, params=None, actor_params=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(candidates [B, n, act], Q [n_critics, B, n])`` for ``n = num_samples`` perturbed VAE samples."""
        params = self.target_qvalue_network_params if params is None else params
        actor_params = self.target_actor_network_params if actor_params is None else actor_params
        batch, n = observation.shape[0], self.num_samples
        repeated = observation.repeat_interleave(n, 0)
        candidates = self._perturb(repeated, self._decode(repeated), actor_params)
        q = self._q(repeated, candidates, params)
        return candidates.reshape(batch, n, -1), q.reshape(self.num_qvalue_nets, batch, n)

    # -- losses -----------------------------------------------------------------------------
    def vae_loss(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, dict]:
        keys = self.tensor_keys
        action = tensordict.get(keys.action)
        td = tensordict.select(*self.vae_network.in_keys, strict=False)
        with self.vae_network_params.to_module(self.vae_network, preserve_module_state=False):
            td = self.vae_network(td)
        recon, mean, std = (td.get(k) for k in self.vae_network.out_keys)
        recon_loss = F.mse_loss(recon, action)
        kl = -0.5 * (1 + torch.log(std.pow(2)) - mean.pow(2) - std.pow(2)).mean()
        loss = recon_loss + self.kl_weight * kl
        return loss, {"vae_recon": recon_loss.detach(), "vae_kl": kl.detach()}

    def qvalue_loss(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, dict]:
        keys = self.tensor_keys
        with torch.no_grad():
            _, q_next = self.candidate_q(tensordict.get(("next", keys.observation)))
            target = self._td0_target(tensordict, bcq_backup(q_next, self.lmbda).unsqueeze(-1))  # BCQ's backup
        pred = self._q(tensordict.get(keys.observation), tensordict.get(keys.action), self.qvalue_network_params)
        loss = distance_loss(pred, target.expand_as(pred), loss_function=self.loss_function).sum(0).mean()
        td_error = (pred.detach() - target).pow(2).max(0).values
        return loss, {"td_error": td_error, "q_data": pred.detach().min(0).values}

    def actor_loss(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, dict]:
        keys = self.tensor_keys
        observation = tensordict.get(keys.observation)
        with torch.no_grad():
            sampled = self._decode(observation)
        perturbed = self._perturb(observation, sampled, self.actor_network_params)
        q1 = self._q(observation, perturbed, self.qvalue_network_params.detach())[0]
        return -q1.mean(), {"perturbation_abs_mean": (perturbed - sampled).detach().abs().mean()}

    def _loss_terms(self, tensordict: TensorDictBase) -> tuple:
        loss_vae, meta_vae = self.vae_loss(tensordict)
        loss_qvalue, meta_q = self.qvalue_loss(tensordict)
        loss_actor, meta_actor = self.actor_loss(tensordict)
        losses = {"loss_actor": loss_actor, "loss_qvalue": loss_qvalue, "loss_vae": loss_vae}
        return losses, meta_q["td_error"], meta_q["q_data"], {**meta_vae, **meta_actor}


class BCQPolicy(TensorDictModuleBase):
    """BCQ's evaluation policy: the best of ``num_samples`` perturbed VAE samples under ``Q_1``.

    The paper's code evaluates 100 candidates per state (10 in the backup). The VAE
    latents are drawn from a generator reseeded with ``seed`` on every call, so the
    policy is a deterministic function of the observation, as evaluation expects.
    """

    def __init__(self, loss: BCQLoss, num_samples: int = 100, seed: int = 0) -> None:
        super().__init__()
        self.loss = loss
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.in_keys = [loss.tensor_keys.observation]
        self.out_keys = [loss.tensor_keys.action]

    @torch.no_grad()
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        loss = self.loss
        observation = tensordict.get(self.in_keys[0])
        flat = observation.reshape(-1, observation.shape[-1])
        n, batch = self.num_samples, flat.shape[0]
        repeated = flat.repeat_interleave(n, 0)
        generator = torch.Generator(device=flat.device).manual_seed(self.seed)
        latent_dim = loss.vae_network.module.latent_dim
        z = torch.randn(repeated.shape[0], latent_dim, generator=generator, device=flat.device, dtype=flat.dtype)
        candidates = loss._perturb(repeated, loss._decode(repeated, z.clamp(-0.5, 0.5)), loss.actor_network_params)
        q1 = loss._q(repeated, candidates, loss.qvalue_network_params)[0].reshape(batch, n)
        best = q1.argmax(-1)
        action = candidates.reshape(batch, n, -1)[torch.arange(batch, device=flat.device), best]
        tensordict.set(self.out_keys[0], action.reshape(*observation.shape[:-1], -1))
        return tensordict


def bcq_allowed_actions(logits: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    r"""Discrete BCQ's support mask: :math:`G(a|s) / \max_{a'} G(a'|s) > \tau`.

    >>> bcq_allowed_actions(torch.log(torch.tensor([[0.6, 0.3, 0.1]])), 0.3)
    tensor([[ True,  True, False]])
    """
    probs = logits.softmax(-1)
    return probs / probs.max(-1, keepdim=True).values > threshold


class DiscreteBCQLoss(TD0TransitionLoss, LossModule):
    r"""Discrete BCQ (Fujimoto et al. 2019, arXiv:1910.01708): DQN restricted to likely actions.

    A behaviour classifier :math:`G(a|s)` allows only actions with
    :math:`G(a|s)/\max_{a'}G(a'|s) > \tau`; the double-DQN target picks the best
    allowed action with the online network and evaluates it with the target one:

    .. math::
        a' = \arg\max_{a: G(a|s')/\max G > \tau} Q(s', a),\quad
        y = r + \gamma (1 - d) \bar Q(s', a') \\
        L_Q = E[\text{Huber}(Q(s, a) - y)],\quad
        L_G = -E[\log G(a|s)] + 10^{-2} E[\text{logits}^2]

    Args:
        value_network: ``Q(s, .)`` reading ``observation``, writing ``action_value`` ``[..., n]``;
            it has a target copy.
        imitation_network: behaviour logits reading ``observation``, writing ``imitation_logits``.

    Keyword Args:
        threshold (float): :math:`\tau` in [0, 1). Defaults to 0.3.
        logit_reg (float): weight of the logits' L2 penalty. Defaults to 1e-2.
        loss_function (str): Q regression loss. Defaults to ``"smooth_l1"`` (Huber, the paper's).
        diagnostics (bool): add ``q_data_mean``, ``mc_return_mean``/``q_data_minus_mc`` (when the
            batch carries ``mc_return``), ``allowed_actions_frac``. Defaults to True.
        columns (DatasetColumns): as :class:`BCQLoss`. Defaults to None.

    Actions are int64 indices.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from offline_plugins.objectives.common import random_transitions
        >>> from tensordict.nn import TensorDictModule
        >>> from offline_plugins.modules.networks import mlp
        >>> q = TensorDictModule(mlp(3, 4, (8,)), ["observation"], ["action_value"])
        >>> g = TensorDictModule(mlp(3, 4, (8,)), ["observation"], ["imitation_logits"])
        >>> loss = DiscreteBCQLoss(q, g)
        >>> loss.make_value_estimator(gamma=0.99)
        >>> batch = random_transitions(torch.randint(4, (5,)), obs_dim=3)
        >>> out = loss(batch)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_imitation', 'loss_qvalue']
        >>> DiscreteBCQPolicy(loss)(TensorDict({"observation": torch.randn(5, 3)}, [5]))["action"].dtype
        torch.int64
    """

    @dataclass
    class _AcceptedKeys(TransitionKeys):
        """Keys the loss reads and writes: those of
        :class:`~offline_plugins.objectives.common.TransitionKeys` (``action``: the dataset's
        int64 action index), and

        Attributes:
            observation (NestedKey): Defaults to ``"observation"``.
            action_value (NestedKey): what the Q network writes. Defaults to ``"action_value"``.
            imitation_logits (NestedKey): what the classifier writes. Defaults to ``"imitation_logits"``.
            value (NestedKey): the next-state value handed to the estimator. Defaults to ``"chosen_action_value"``.
        """

        observation: NestedKey = "observation"
        action_value: NestedKey = "action_value"
        imitation_logits: NestedKey = "imitation_logits"
        value: NestedKey = "chosen_action_value"

    tensor_keys: _AcceptedKeys
    default_keys = _AcceptedKeys
    default_value_estimator = ValueEstimators.TD0
    out_keys = ["loss_qvalue", "loss_imitation"]
    _next_value_key = "value"

    value_network: TensorDictModule
    imitation_network: TensorDictModule
    value_network_params: TensorDictParams
    target_value_network_params: TensorDictParams
    imitation_network_params: TensorDictParams
    target_imitation_network_params: TensorDictParams

    def __init__(
        self,
        value_network: TensorDictModule,
        imitation_network: TensorDictModule,
        *,
        threshold: float = 0.3,
        logit_reg: float = 1e-2,
        loss_function: str = "smooth_l1",
        diagnostics: bool = True,
        columns: Optional[DatasetColumns] = None,
    ) -> None:
        check_range("DiscreteBCQLoss", "threshold", threshold, 0.0, 1.0, low_inclusive=True)
        check_range("DiscreteBCQLoss", "logit_reg", logit_reg, 0.0, None, low_inclusive=True)
        super().__init__()
        self.convert_to_functional(value_network, "value_network", create_target_params=True)
        self.convert_to_functional(imitation_network, "imitation_network", create_target_params=False)
        self.register_buffer("threshold", torch.tensor(float(threshold)))
        self.register_buffer("logit_reg", torch.tensor(float(logit_reg)))
        self.loss_function = loss_function
        self.diagnostics = diagnostics
        self._set_columns(columns)

    def _run(self, module: TensorDictModule, params, observation: torch.Tensor, out_key: NestedKey) -> torch.Tensor:
        td = TensorDict({self.tensor_keys.observation: observation}, observation.shape[:-1])
        with params.to_module(module, preserve_module_state=False):
            return module(td).get(out_key)

    def greedy_allowed(self, observation: torch.Tensor, q_params=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(best allowed action, allowed mask)`` at ``observation``, using online Q unless ``q_params``."""
        keys = self.tensor_keys
        q_params = self.value_network_params if q_params is None else q_params
        q = self._run(self.value_network, q_params.detach(), observation, keys.action_value)
        logits = self._run(self.imitation_network, self.imitation_network_params.detach(), observation, keys.imitation_logits)
        allowed = bcq_allowed_actions(logits, self.threshold)
        # the most likely action is always allowed, so the masked argmax is well defined
        return q.masked_fill(~allowed, float("-inf")).argmax(-1), allowed

    def qvalue_loss(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, dict]:
        keys = self.tensor_keys
        with torch.no_grad():
            next_obs = tensordict.get(("next", keys.observation))
            next_action, allowed = self.greedy_allowed(next_obs)
            q_next = self._run(self.value_network, self.target_value_network_params, next_obs, keys.action_value)
            target = self._td0_target(tensordict, q_next.gather(-1, next_action.unsqueeze(-1)))
        q = self._run(self.value_network, self.value_network_params, tensordict.get(keys.observation), keys.action_value)
        action = tensordict.get(keys.action).long().reshape(*q.shape[:-1], 1)
        pred = q.gather(-1, action).squeeze(-1)
        loss = distance_loss(pred, target, loss_function=self.loss_function).mean()
        return loss, {
            "td_error": (pred.detach() - target).pow(2),
            "q_data": pred.detach(),
            "allowed_actions_frac": allowed.float().mean(),
        }

    def imitation_loss(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, dict]:
        keys = self.tensor_keys
        logits = self._run(
            self.imitation_network, self.imitation_network_params, tensordict.get(keys.observation), keys.imitation_logits
        )
        action = tensordict.get(keys.action).long().reshape(logits.shape[:-1])
        nll = F.cross_entropy(logits, action)
        return nll + self.logit_reg * logits.pow(2).mean(), {"imitation_nll": nll.detach()}

    def _loss_terms(self, tensordict: TensorDictBase) -> tuple:
        loss_qvalue, meta_q = self.qvalue_loss(tensordict)
        loss_imitation, meta_i = self.imitation_loss(tensordict)
        diagnostics = {"allowed_actions_frac": meta_q["allowed_actions_frac"], **meta_i}
        return {"loss_qvalue": loss_qvalue, "loss_imitation": loss_imitation}, meta_q["td_error"], meta_q["q_data"], diagnostics


class DiscreteBCQPolicy(TensorDictModuleBase):
    """Discrete BCQ's evaluation policy: the highest-Q action among those the classifier allows."""

    def __init__(self, loss: DiscreteBCQLoss) -> None:
        super().__init__()
        self.loss = loss
        self.in_keys = [loss.tensor_keys.observation]
        self.out_keys = [loss.tensor_keys.action]

    @torch.no_grad()
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        action, _ = self.loss.greedy_allowed(tensordict.get(self.in_keys[0]))
        tensordict.set(self.out_keys[0], action)
        return tensordict
