"""The offline-RL glue: every registered algorithm builds, trains and evaluates on tiny data."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest
import torch
from tensordict import TensorDict

from _offline_train import train
from _synthetic import synthetic_transitions
from offline_plugins.errors import UserError
from offline_plugins.plugins.manager import load_registry

torch.set_num_threads(1)

# name -> (action space, the loss term that must fall on a fixed batch)
ALGORITHMS = {
    "bc": ("continuous", "loss_bc"),
    "bc-discrete": ("discrete", "loss_bc"),
    "iql": ("continuous", "loss_value"),
    "iql-discrete": ("discrete", "loss_qvalue"),
    "td3-bc": ("continuous", "loss_qvalue"),
    "cql": ("continuous", "loss_cql"),
    "cql-lagrange": ("continuous", "loss_qvalue"),
    "cql-discrete": ("discrete", "loss_cql"),
    "bcq": ("continuous", "loss_vae"),
    "bcq-discrete": ("discrete", "loss_imitation"),
    "awac": ("continuous", "loss_qvalue"),
}


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def _data(action_space: str, n: int = 64, **kwargs):
    if action_space == "continuous":
        data, batch = synthetic_transitions(n, obs_dim=3, action_dim=2, seed=1, **kwargs)
    else:
        data, batch = synthetic_transitions(n, obs_dim=3, num_actions=3, seed=1, **kwargs)
    # what the replay buffer writes: the loss's columns (the discounted mc_return) are looked up by it
    batch["index"] = torch.arange(n)
    return data, batch


def _small(spec, **overrides):
    config = spec.default_config()
    changes = {"hidden": (32, 32), "num_random": 2, "eval_samples": 10}
    for name in ("vae_hidden",):
        if hasattr(config, name):
            changes[name] = (32, 32)
    for f in dataclasses.fields(config):
        if f.name == "lr" or f.name.endswith("_lr"):
            changes[f.name] = 1e-3
    changes.update(overrides)
    return dataclasses.replace(config, **{k: v for k, v in changes.items() if hasattr(config, k)})


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_registered_with_spec(registry, name):
    spec = registry.algorithm(name)
    assert spec.family == "offline-rl" and spec.data == "transitions"
    assert spec.action_spaces == (ALGORITHMS[name][0],)
    assert spec.load_loss_class().__name__.endswith("Loss")
    assert spec.paper


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_build_train_and_act(registry, name):
    torch.manual_seed(0)
    action_space, falling = ALGORITHMS[name]
    spec = registry.algorithm(name)
    data, batch = _data(action_space)
    parts = spec.load_build()(_small(spec), data)
    assert isinstance(parts.loss, spec.load_loss_class())
    out = parts.loss(batch.clone())
    for key in parts.loss_keys():
        assert key.startswith("loss_") and out[key].shape == () and torch.isfinite(out[key]), key
    for key in out.keys():
        if not key.startswith("loss_"):
            assert not out[key].requires_grad, f"diagnostic {key} must be detached"

    history = train(parts, batch, 40)
    first = torch.stack([h[falling] for h in history[:5]]).mean()
    last = torch.stack([h[falling] for h in history[-5:]]).mean()
    assert last < first, f"{name}: {falling} did not fall ({float(first):.4f} -> {float(last):.4f})"

    obs = TensorDict({"observation": batch["observation"][:7]}, [7])
    a1 = parts.policy(obs.clone())["action"]
    a2 = parts.policy(obs.clone())["action"]
    assert torch.equal(a1, a2), "the evaluation policy must be deterministic"
    if action_space == "continuous":
        assert a1.shape == (7, 2) and bool((a1.abs() <= 1).all())
    else:
        assert a1.shape == (7,) and a1.dtype == torch.int64 and bool(((a1 >= 0) & (a1 < 3)).all())


@pytest.mark.parametrize("name", ["iql", "td3-bc", "cql", "cql-discrete", "iql-discrete", "bcq", "awac"])
def test_over_estimation_diagnostic(registry, name):
    from offline_plugins.objectives.columns import discounted_returns

    spec = registry.algorithm(name)
    config = _small(spec)
    data, batch = _data(ALGORITHMS[name][0])
    out = spec.load_build()(config, data).loss(batch.clone())
    q = out["q_data_mean"]
    assert torch.allclose(out["mc_return_mean"], discounted_returns(data.td, config.gamma).mean())
    assert torch.isfinite(q) and torch.isfinite(out["q_data_minus_mc"])


# one episode of 3 rewards of 1 (terminated at its end): the data layer's undiscounted return_to_go
# is 3, 2, 1; discounted at gamma = 0.5 it is 1 + .5 (1 + .5 * 1) = 1.75, 1.5, 1
_EPISODE_MC_MEAN = (1.75 + 1.5 + 1.0) / 3
_MC_NAMES = {name: ALGORITHMS[name][0] for name in
             ["iql", "iql-discrete", "td3-bc", "cql", "cql-discrete", "awac", "bcq", "bcq-discrete"]}
_MC_NAMES.update({"rebrac": "continuous", "sac-n": "continuous", "edac": "continuous", "cal-ql": "continuous"})


@pytest.mark.parametrize("name", sorted(_MC_NAMES))
def test_monte_carlo_diagnostics_read_the_return_discounted_at_the_loss_gamma(registry, name):
    """q_data_minus_mc compares Q, a return discounted at gamma, with the data's return discounted at
    the same gamma (the build's mc_return column), not with the undiscounted return_to_go."""
    torch.manual_seed(0)
    spec = registry.algorithm(name)
    data, batch = _data(_MC_NAMES[name], n=3, episode_len=3)
    for td in (data.td, batch):
        td["next", "reward"] = torch.ones(3, 1)
        td["return_to_go"] = torch.tensor([[3.0], [2.0], [1.0]])  # the data layer's: undiscounted
    loss = spec.load_build()(_small(spec, gamma=0.5), data).loss
    out = loss(batch.clone())
    assert float(out["mc_return_mean"]) == pytest.approx(_EPISODE_MC_MEAN)
    torch.testing.assert_close(out["q_data_minus_mc"], out["q_data_mean"] - out["mc_return_mean"])
    # a batch that carries its own mc_return keeps it (a user's pipeline, a keyword call)
    own = batch.clone().set("mc_return", torch.full((3, 1), 7.0))
    assert float(loss(own)["mc_return_mean"]) == pytest.approx(7.0)


@pytest.mark.parametrize("name", ["iql", "td3-bc", "cql", "cql-discrete", "iql-discrete"])
def test_monte_carlo_diagnostics_need_stored_episodes_not_a_return_to_go(registry, name):
    # the glue computes mc_return from the stored episodes (data.td): data without a return_to_go
    # still gets the pair, data without stored episodes does not
    spec = registry.algorithm(name)
    data, batch = _data(ALGORITHMS[name][0])
    data.td = data.td.exclude("return_to_go")
    loss = spec.load_build()(_small(spec), data).loss
    assert {"mc_return_mean", "q_data_minus_mc"} <= set(loss.out_keys)
    assert set(loss.out_keys) <= set(loss(batch.exclude("return_to_go")).keys())

    data.td = None
    loss = spec.load_build()(_small(spec), data).loss
    assert "q_data_mean" in loss.out_keys
    assert not {"mc_return_mean", "q_data_minus_mc"} & set(loss.out_keys)
    assert set(loss.out_keys) <= set(loss(batch.exclude("return_to_go", "index")).keys())


def test_cql_gap_and_iql_advantage_statistics(registry):
    data, batch = _data("continuous")
    out = registry.algorithm("cql-lagrange").load_build()(_small(registry.algorithm("cql-lagrange")), data).loss(batch)
    assert {"cql_gap", "alpha_prime"} <= set(out.keys())
    out = registry.algorithm("iql").load_build()(_small(registry.algorithm("iql")), data).loss(batch.clone())
    assert {"value_mean", "advantage_mean", "advantage_std", "advantage_weight_mean"} <= set(out.keys())
    assert 0 < float(out["advantage_weight_mean"]) <= 100


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_wrong_action_space_is_a_user_error(registry, name):
    action_space = ALGORITHMS[name][0]
    other = "discrete" if action_space == "continuous" else "continuous"
    data, _ = _data(other)
    spec = registry.algorithm(name)
    with pytest.raises(UserError, match=f"{name}.*{other}"):
        spec.load_build()(_small(spec), data)


@pytest.mark.parametrize(
    "name, key, value",
    [("iql", "expectile", 1.5), ("iql", "temperature", -1.0), ("td3-bc", "alpha", -1.0),
     ("cql", "min_q_weight", -1.0), ("bc", "lr", 0.0), ("iql", "gamma", 1.5), ("bcq", "lmbda", 2.0),
     ("bcq", "phi", -0.1), ("awac", "beta", 0.0), ("bcq-discrete", "threshold", 1.5)],
)
def test_bad_config_names_the_field(registry, name, key, value):
    spec = registry.algorithm(name)
    data, _ = _data(ALGORITHMS[name][0])
    with pytest.raises(UserError, match=key):
        spec.load_build()(_small(spec, **{key: value}), data)


@pytest.mark.parametrize("name", ["iql", "td3-bc", "cql", "bc", "bcq", "awac", "cql-discrete", "bcq-discrete"])
def test_missing_batch_key_is_a_user_error(registry, name):
    spec = registry.algorithm(name)
    data, batch = _data(ALGORITHMS[name][0])
    parts = spec.load_build()(_small(spec), data)
    with pytest.raises(UserError, match="'action'"):
        parts.loss(batch.exclude("action"))


def test_glue_modules_import_no_torch():
    code = (
        "import sys, offline_plugins.algorithms.bc, offline_plugins.algorithms.iql, "
        "offline_plugins.algorithms.td3_bc, offline_plugins.algorithms.cql, "
        "offline_plugins.algorithms.bcq, offline_plugins.algorithms.awac; "
        "print('torch' in sys.modules)"
    )
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert time.perf_counter() - t0 < 3
