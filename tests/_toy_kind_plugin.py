"""A third-party plugin that adds a new data kind, as docs/plugins.md describes.

The kind, ``labelled-vectors``, is noisy linear-regression data: dataset ids
``toy-vectors:N`` (``N`` rows of ``x`` in R^4 and ``y = x . w + noise``). Its algorithm,
``toy-linreg``, fits ``w`` with a mean-squared-error TorchRL loss. The kind scores a run
by the held-out MSE, adds ``heldout_mse`` to ``summary.json`` and exports the weights as
a ``.pt`` file. Nothing in offline-plugins knows any of this: the shell asks the kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.objectives import LossModule

from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup
from offline_plugins.config import config_field
from offline_plugins.errors import UserError
from offline_plugins.kinds import DataKind, LoadedData
from offline_plugins.lightning.callbacks import ScheduledEvaluation
from offline_plugins.plugins import AlgorithmSpec, hookimpl

TRUE_W = torch.tensor([1.0, -2.0, 0.5, 3.0])


class VectorData:
    """The loaded dataset: training and held-out rows, and the replay buffer the shell samples."""

    action_space = None

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 4, generator=g)
        y = x @ TRUE_W + 0.01 * torch.randn(n, generator=g)
        cut = int(0.8 * n)
        self.train = TensorDict({"x": x[:cut], "y": y[:cut, None]}, [cut])
        self.test = TensorDict({"x": x[cut:], "y": y[cut:, None]}, [n - cut])

    def replay_buffer(self, batch_size, *, sampler="random", slice_len=None, seed=0, device="cpu"):
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(self.train.batch_size[0], device=device),
                                    batch_size=batch_size)
        rb.extend(self.train.to(device))
        return rb


class HeldOutMSE(ScheduledEvaluation):
    def __init__(self, data: VectorData, *, every: int) -> None:
        self.data, self.every, self.history = data, int(every), []

    @property
    def state_key(self) -> str:
        return "HeldOutMSE"

    def _score(self, trainer, pl_module):
        with torch.no_grad():
            test = self.data.test.to(pl_module.device)
            mse = float(((pl_module.policy(test.clone())["y_hat"] - test["y"]) ** 2).mean())
        return {"heldout_mse": mse}, {"eval/heldout_mse": mse}


class LabelledVectors(DataKind):
    name = "labelled-vectors"
    summary = "rows of (x, y) for regression (a test plugin's kind)"
    description = "a toy regression dataset"
    train_hint = "train toy-linreg on it"

    def claims(self, dataset: str) -> bool:
        return dataset.startswith("toy-vectors:")

    def resolve(self, dataset, *, spec, registry):
        if not self.claims(dataset) or not dataset.split(":", 1)[1].isdigit():
            raise UserError(f"{spec.name} reads toy-vectors:N datasets, got {dataset!r}")
        return dataset, None

    def load(self, dataset_id, *, spec, config, registry, device, progress, options):
        n = int(dataset_id.split(":", 1)[1])
        return LoadedData(VectorData(n), {"n": n})

    def evaluation(self, data, *, every, episodes, seed):
        return HeldOutMSE(data, every=every)

    def summary_fields(self, evaluation, data, *, eval_episodes):
        last = evaluation.history[-1] if evaluation.history else {}
        return {"heldout_mse": last.get("heldout_mse"), "train_rows": int(data.train.batch_size[0])}

    def export(self, parts, out: Path):
        path = out / "weights.pt"
        torch.save(parts.policy.module.weight.detach().cpu(), path)
        return {"weights": str(path)}

    def evaluate(self, module, data, *, episodes, seed, device):
        with torch.no_grad():
            test = data.test.to(device)
            return {"heldout_mse": float(((module.policy(test.clone())["y_hat"] - test["y"]) ** 2).mean())}

    def describe(self, result: dict) -> str:
        return f"{result['algorithm']} on {result['dataset']}: held-out MSE {result['heldout_mse']:.4f}"


class MSELoss(LossModule):
    def __init__(self, model: TensorDictModule) -> None:
        super().__init__()
        self.model = model

    def forward(self, td):
        out = self.model(td.clone(False))
        return TensorDict({"loss_mse": ((out["y_hat"] - td["y"]) ** 2).mean()}, [])


@dataclass
class LinRegConfig:
    lr: float = config_field(0.05, "Adam learning rate")
    batch_size: int = config_field(32, "rows per step")


def build(config: LinRegConfig, data: VectorData):
    model = TensorDictModule(torch.nn.Linear(4, 1, bias=False), ["x"], ["y_hat"])
    return AlgorithmParts(loss=MSELoss(model), policy=model,
                          optimizers=[OptimizerGroup("model", list(model.parameters()), config.lr, ("loss_mse",))])


@hookimpl
def offline_plugins_register_data_kinds(registry):
    registry.add(LabelledVectors())


@hookimpl
def offline_plugins_register_algorithms(registry):
    registry.add(AlgorithmSpec(name="toy-linreg", summary="least squares on labelled vectors", family="offline-rl",
                               data="labelled-vectors", loss=MSELoss, build=build, config=LinRegConfig))
