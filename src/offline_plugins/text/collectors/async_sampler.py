"""Rounds of rollouts sampled beside training: :class:`AsyncSampler`, a worker process with its own
copy of the policy whose weights live in shared memory.

An online run with ``--set async_rollouts=true`` samples round ``r + 1`` while it trains on round
``r``. The sampler is a forked process (a thread cannot do it: a round's sampling forks and seeds
torch's global RNG, which the trainer's thread uses at the same time), holding a copy of the
policy whose parameters are shared-memory tensors (``TensorDict.from_module(copy).share_memory_()``):
the trainer writes the policy's weights into them in place (``snapshot``) at a step it chooses,
then asks for a round; the worker samples and scores it with the run's collector (prompts,
seeds, reward, reference: everything the synchronous round uses, inherited at the fork) and sends
the rows back. The trainer writes the weights only while no round is being sampled, so a round is
sampled by one version of the weights, named by the step it was taken at.

Why not TorchRL's ``aSyncDataCollector`` and ``SharedMemWeightSyncScheme``: the collector yields
batches when they are ready, from whatever weights its worker holds then, where a reproducible
run needs round ``r`` sampled from the weights of a step fixed by ``r`` and ``max_staleness`` (and a
resumed run the same); the scheme applies weights in a receiver thread on an instruction of its
own, a second channel that could land in the middle of a round. What they do underneath is what
is used here: the policy's parameters as a shared-memory TensorDict updated in place.

With ``--generator vllm`` the worker starts its own vLLM engine from the first round's weights and
loads each later round's into it before sampling (the trainer's process starts none).

The worker ignores SIGINT (the trainer stops it at a step boundary) and exits when the trainer's
process is gone (``kill -9``), when asked, or when its pipe closes. It needs the ``fork`` start
method (Linux) and a CPU policy: a CUDA context does not survive a fork.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import signal
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict

from offline_plugins.errors import UserError

__all__ = ["AsyncSampler", "AsyncSamplerError"]


class AsyncSamplerError(UserError, RuntimeError):
    """The sampler process failed or is gone."""


class AsyncSampler:
    """A worker process sampling rounds with a shared-memory copy of ``policy``.

    Args:
        collector: the run's :class:`~offline_plugins.text.collectors.collector.RolloutCollector`.
        policy: the policy being trained (copied once; later weights arrive by :meth:`snapshot`).

    Keyword Args:
        signal: ``signal(rows) -> rows`` with ``"has_signal"`` written from the rewards alone, for
            dynamic sampling in the worker (the loss's own ``process_rollouts`` runs in the trainer).
        dynamic_sampling: replace groups without signal by newly sampled ones (DAPO).
        after_fork: called first thing in the worker (the run closes its folder lock's inherited
            descriptor there, so a killed run's folder is free again once the worker exits).
        generator: an engine with :class:`~offline_plugins.text.backends.vllm_engine.VLLMGenerator`'s contract
            that samples in the worker instead of the copy's ``generate`` (``--generator vllm``): started in
            the worker from the first round's weights, loaded with each later round's before it is sampled.
    """

    def __init__(self, collector: Any, policy: torch.nn.Module, *, signal: Optional[Callable] = None,
                 dynamic_sampling: bool = False, after_fork: Optional[Callable[[], None]] = None,
                 generator: Optional[Any] = None) -> None:
        if "fork" not in mp.get_all_start_methods():
            raise AsyncSamplerError("async_rollouts samples in a forked process, and this platform cannot fork; "
                                    "train with --set async_rollouts=false")
        device = next(policy.parameters()).device
        if device.type != "cpu":
            raise AsyncSamplerError(f"async_rollouts samples in a forked process, which cannot use the policy's "
                                    f"{device.type} device (its context does not survive a fork); train with "
                                    "--set async_rollouts=false on this device")
        self.model = copy.deepcopy(policy).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.weights = TensorDict.from_module(self.model).share_memory_()
        self.version: Optional[int] = None  # the step of the weights in shared memory
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_work, args=(child, collector, self.model, signal, bool(dynamic_sampling),
                                                       os.getpid(), after_fork, generator),
                                   daemon=True, name="offline-plugins-sampler")
        self.process.start()
        child.close()
        self.pending: Optional[tuple[int, int]] = None  # (round, version) asked for and not yet received

    @torch.no_grad()
    def snapshot(self, policy: torch.nn.Module, step: int) -> None:
        """Write ``policy``'s weights (those of optimiser step ``step``) into the shared copy."""
        if self.pending is not None:
            raise RuntimeError("AsyncSampler.snapshot while a round is being sampled")
        self.weights.update_(TensorDict.from_module(policy).detach())
        self.version = int(step)

    def request(self, round: int, rank: int = 0) -> None:
        """Ask the worker for round ``round`` sampled with the weights of the last snapshot."""
        if self.pending is not None:
            raise RuntimeError("AsyncSampler.request while a round is being sampled")
        self._send(("sample", int(round), int(rank)))
        self.pending = (int(round), int(self.version))

    def result(self) -> tuple[int, int, TensorDict, dict]:
        """``(round, version, rows, stats)`` of the round asked for (waits for it)."""
        if self.pending is None:
            raise RuntimeError("AsyncSampler.result with no round asked for")
        round, version = self.pending
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self.pending = None
            raise AsyncSamplerError(f"the sampler process (pid {self.process.pid}) ended while sampling round "
                                    f"{round} (exit code {self.process.exitcode}); resume the run with --resume, "
                                    "which samples the round again") from None
        self.pending = None
        if msg[0] == "error":
            _, kind, text, user = msg
            if user:
                raise AsyncSamplerError(text)
            raise AsyncSamplerError(f"the sampler process failed on round {round}: {kind}: {text}")
        _, td, stats = msg
        return round, version, td, stats

    def close(self) -> None:
        """Stop the worker (a round being sampled is dropped)."""
        try:
            self._send(("stop",))
        except AsyncSamplerError:
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        self._conn.close()
        self.pending = None

    def _send(self, msg: tuple) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError):
            raise AsyncSamplerError(f"the sampler process (pid {self.process.pid}) is gone (exit code "
                                    f"{self.process.exitcode}); resume the run with --resume") from None


def _work(conn, collector, model, signal_fn, dynamic_sampling: bool, parent: int,
          after_fork: Optional[Callable[[], None]], generator: Optional[Any]) -> None:
    """The worker's loop: sample the rounds asked for until told to stop or the trainer is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer at a step boundary; it stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the trainer's graceful handler: a terminate() ends us
    if after_fork is not None:
        after_fork()
    torch.set_num_threads(1)
    collector.generator = generator
    try:
        _serve(conn, collector, model, signal_fn, dynamic_sampling, parent, generator)
    finally:
        if generator is not None:
            generator.close()


def _serve(conn, collector, model, signal_fn, dynamic_sampling: bool, parent: int, generator: Optional[Any]) -> None:
    while True:
        try:
            if not conn.poll(1.0):
                if os.getppid() != parent:  # the trainer was killed: nothing will ask any more
                    return
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        _, round, rank = msg
        try:
            if generator is not None:  # the engine samples from the weights just written to the shared copy
                generator.start(model) if generator.engine is None else generator.sync(model)
            td, stats = collector.collect(model, round=round, rank=rank, process=signal_fn,
                                          dynamic_sampling=dynamic_sampling)
            reply = ("ok", td, stats)
        except BaseException as exc:  # noqa: BLE001 - sent to the trainer, which raises it with its context
            reply = ("error", type(exc).__name__, str(exc), isinstance(exc, UserError))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
