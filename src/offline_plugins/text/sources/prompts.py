"""Prompts and rewards of a text task: where prompts come from and how a response is scored.

A :class:`PromptSource` holds the training and held-out prompts and the reward: the
built-in arithmetic task (its verifier), a JSONL file of ``prompt``/``answer`` rows (exact
match), or prompt rows with a user's reward function ``module:function`` called as
TRL's reward functions are, ``fn(prompts, responses, **columns) -> list[float]``.
Held-out prompts are split off deterministically by a hash of their text
(:func:`~offline_plugins.text.tasks.base.held_out_prompts`, as the preference loader).
Importing it imports no torch (an algorithm's module may subclass :class:`PromptSource`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import multiprocessing
import pickle
import random
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from offline_plugins.data.jsonl import jsonl_objects
from offline_plugins.errors import UserError
from offline_plugins.plugins import UnknownNameError, shared_registry
from offline_plugins.text.sources.remote import RemoteReward, is_url
from offline_plugins.text.tasks import exact_match
from offline_plugins.text.tasks.base import held_out_prompts

__all__ = ["RolloutError", "RolloutInterrupted", "RewardGuard", "rollout_seed", "PromptSource", "task_prompt_source", "jsonl_prompt_source",
           "load_reward_function", "reward_specs", "combined_reward", "score_responses", "score_parts",
           "read_jsonl_rows"]


class RolloutError(UserError, ValueError):
    """A reward function, prompt file or rollout setting that cannot be used."""


class RolloutInterrupted(RolloutError):
    """SIGINT/SIGTERM arrived while a reward function was still running: the run stops there."""

    exit_code = 130


def rollout_seed(*parts: int) -> int:
    """A 63-bit seed from integers (seed, rank, round, attempt): the same everywhere, every run.

    >>> rollout_seed(0, 0, 1) != rollout_seed(0, 1, 1)
    True
    """
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class PromptSource:
    """Training and held-out prompts, and how a response to one is scored.

    Attributes:
        name: what the source is, for messages (``"arithmetic-2d+"``, a file path).
        train: the training rows (dicts with at least ``"prompt"``), or None when ``sample``
            draws them (a task makes fresh problems).
        held_out: the held-out rows.
        reward_fn: ``fn(prompts, responses, **columns) -> list[float]``.
        reward_name: the function's name, for error messages.
        sample_fn: ``sample_fn(n, seed) -> rows`` (a task); default: draw from ``train``.
        max_prompt_chars: the longest prompt the source can give (tasks: their longest form).
        multiturn: None (one response per episode), or the
            :class:`~offline_plugins.text.tools.multiturn.MultiTurn` of episodes with tools.
        components: ``[(name, fn), ...]`` when the run was given several rewards (``--reward NAME=SPEC``
            twice or more): each response is scored by each (:func:`score_parts`), and ``reward_fn`` is
            their sum weighted by ``reward_weights`` (:func:`combined_reward`). Empty: one reward.
        reward_weights: one weight per component.
    """

    name: str
    held_out: list[dict]
    reward_fn: Callable[..., Sequence[float]]
    reward_name: str
    train: Optional[list[dict]] = None
    sample_fn: Optional[Callable[[int, int], list[dict]]] = None
    longest_prompts: list[str] = field(default_factory=list)
    multiturn: Optional[Any] = None
    components: list = field(default_factory=list)
    reward_weights: list = field(default_factory=list)

    @property
    def reward_names(self) -> list[str]:
        """The names of the rewards when there are several (``components``), else ``[]``."""
        return [name for name, _ in self.components]

    def sample(self, n: int, seed: int) -> list[dict]:
        """``n`` training rows drawn with ``seed`` (with replacement)."""
        if self.sample_fn is not None:
            return self.sample_fn(n, seed)
        rng = random.Random(seed)
        return [self.train[rng.randrange(len(self.train))] for _ in range(n)]

    @property
    def has_answers(self) -> bool:
        return bool(self.held_out) and all("answer" in r for r in self.held_out)


def task_prompt_source(task: Any, *, n_held_out: int = 200) -> PromptSource:
    """A built-in verifiable task: fresh train-split problems per round, test-split problems held out."""
    held = [{"prompt": p.prompt, "answer": p.answer} for p in task.problems(n_held_out, split="test", seed=1)]

    def sample(n: int, seed: int) -> list[dict]:
        return [{"prompt": p.prompt, "answer": p.answer} for p in task.problems(n, split="train", seed=seed)]

    def reward(prompts, responses, **_):
        return task.rewards(prompts, responses)

    longest = getattr(task, "longest_prompts", None)
    if not longest and hasattr(task, "digits") and hasattr(task, "ops"):  # the arithmetic tasks' widest operands
        longest = [f"{'9' * task.digits}{op}{'9' * task.digits}=" for op in task.ops]
    if not longest:  # a task that states no bound (a plugin's): the longest of many of its prompts
        many = [p.prompt for p in task.problems(2000, split="train", seed=0)] + [r["prompt"] for r in held]
        longest = sorted(many, key=len)[-8:]
    return PromptSource(task.name, held, reward, f"{task.name} verifier", sample_fn=sample, longest_prompts=longest,
                        multiturn=getattr(task, "multiturn", None))


def _exact_match(prompts, responses, answer=None, **_):
    return [exact_match(r, a) for r, a in zip(responses, answer)]


#: the ``--reward NAME=SPEC`` spec that names the task's own verifier (a JSONL file's: exact match)
TASK_REWARD = "task"


def reward_specs(reward: Any) -> Optional[list[tuple[str, str]]]:
    """``[(name, spec), ...]`` of several ``--reward NAME=SPEC`` flags, None for one reward (a string,
    or a list of one: its spec as given, a ``NAME=`` prefix dropped); a :class:`RolloutError` naming
    the flag that is not ``NAME=SPEC`` or a name given twice.

    >>> reward_specs(["correct=task", "format=mymod:fmt"])
    [('correct', 'task'), ('format', 'mymod:fmt')]
    >>> reward_specs("mymod:score") is None
    True
    """
    if reward is None or isinstance(reward, str):
        return None
    flags = [str(r) for r in reward]
    if len(flags) < 2:
        return None
    out: list[tuple[str, str]] = []
    for flag in flags:
        name, sep, spec = flag.partition("=")
        if not sep or not name.replace("_", "").replace("-", "").isalnum() or not spec:
            raise RolloutError(f"--reward {flag!r}: several rewards are given as NAME=SPEC, each with a name "
                               "(e.g. --reward correct=task --reward format=mymod:fmt; SPEC is a module:function, a "
                               "reward-model folder, a server URL, or 'task' for the task's own verifier)")
        if name in [n for n, _ in out]:
            raise RolloutError(f"--reward: the name {name!r} is given twice; give each reward its own name")
        out.append((name, spec))
    return out


def single_reward(reward: Any) -> Optional[str]:
    """The one reward spec of ``reward`` (a string, or a list of one), a ``NAME=`` prefix dropped; None for
    ``task`` (the dataset's own reward, as if ``--reward`` were not given).

    >>> single_reward("mymod:score"), single_reward(["correct=mymod:score"]), single_reward("correct=task")
    ('mymod:score', 'mymod:score', None)
    """
    if reward is None:
        return None
    flag = str(reward) if isinstance(reward, str) else (str(list(reward)[0]) if list(reward) else "")
    if not flag:
        return None
    name, sep, spec = flag.partition("=")
    if sep and spec and ":" not in name and "/" not in name:
        flag = spec
    return None if flag == TASK_REWARD else flag


def combined_reward(components: Sequence[tuple[str, Callable]], weights: Sequence[float]) -> Callable:
    """One reward function from several: ``sum_k w_k * f_k(prompts, responses, **columns)``."""
    def reward(prompts, responses, **columns):
        total = [0.0] * len(prompts)
        for (name, fn), w in zip(components, weights):
            values = list(fn(prompts, responses, **columns))
            if len(values) != len(prompts):
                raise RolloutError(f"reward {name} returned {len(values)} rewards for {len(prompts)} responses")
            total = [t + float(w) * float(v) for t, v in zip(total, values)]
        return total

    reward.__qualname__ = " + ".join(f"{w:g}*{name}" for (name, _), w in zip(components, weights))
    return reward


def score_parts(source: PromptSource, rows: Sequence[dict], responses: Sequence[str], *,
                guard: Optional[RewardGuard] = None) -> tuple[list[float], Optional[list[list[float]]]]:
    """``(reward, components)``: each response's reward, and with several rewards (``source.components``)
    each one's scores, ``[K][B]``, their weighted sum the reward (else ``(score_responses(...), None)``).
    Each component is scored as :func:`score_responses` scores one reward: its checks, its guard, its
    name in every error."""
    if not source.components:
        return score_responses(source, rows, responses, guard=guard), None
    parts = [score_responses(replace(source, reward_fn=fn, reward_name=name, components=[]), rows, responses,
                             guard=guard) for name, fn in source.components]
    total = [sum(float(w) * p[i] for w, p in zip(source.reward_weights, parts)) for i in range(len(responses))]
    return total, parts


def load_reward_function(spec: str) -> Callable[..., Sequence[float]]:
    """The callable ``module:function`` names (``--reward``); a ``UserError`` naming what is wrong."""
    from offline_plugins.text.sources.reward_source import is_reward_model_dir, reward_model_function

    if is_url(spec):  # an offline-plugins serve reward server (offline_plugins.text.sources.remote)
        return RemoteReward(str(spec))
    if Path(str(spec)).is_dir():  # a reward-model run's OUT dir or its exported OUT/reward_model
        if not is_reward_model_dir(spec):
            from offline_plugins.text.sources.reward_source import _folder

            _folder(spec)  # raises, naming what the folder lacks
        return reward_model_function(spec)
    module_name, sep, attr = str(spec).partition(":")
    if not sep:  # a registered reward function's name ('offline-plugins list', "rewards")
        return _registered_reward(str(spec))
    if not module_name or not attr:
        raise RolloutError(f"--reward {spec!r} must be 'module:function' (e.g. mytask.rewards:score), a Python "
                           "callable (prompts, responses, **columns) -> list[float], or a registered reward's name")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module
        raise RolloutError(f"--reward {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
                           "put it on PYTHONPATH or install it") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise RolloutError(f"--reward {spec!r}: module {module_name!r} has no attribute {attr!r}; name a "
                               "function defined in it")
    if not callable(fn):
        raise RolloutError(f"--reward {spec!r} is a {type(fn).__name__}, not a callable; name a function "
                           "(prompts, responses, **columns) -> list[float]")
    return fn


def _registered_reward(name: str) -> Callable[..., Sequence[float]]:
    """The function of the reward registered as ``name``; a :class:`RolloutError` naming the registered ones
    and the other forms ``--reward`` takes."""
    registry = shared_registry()
    try:
        spec = registry.reward(name)
    except UnknownNameError as exc:
        raise RolloutError(f"--reward {name!r}: {exc}; --reward takes a registered reward's name ('offline-plugins "
                           "list', \"rewards\"), a module:function (e.g. mytask.rewards:score), a reward-model folder or "
                           "a reward server's http://HOST:PORT") from None
    try:
        return spec.load()
    except Exception as exc:  # noqa: BLE001 - a plugin's broken import path: named with its plugin
        raise RolloutError(f"--reward {name!r}: the reward registered by {spec.provider or 'a plugin'} (plugin "
                           f"{spec.plugin!r}) cannot be loaded from {spec.to_dict()['function']!r} "
                           f"({type(exc).__name__}: {exc})") from None


@dataclass
class RewardGuard:
    """How a reward function is called: under a time limit, with a defined reward for a call that fails.

    A call of ``fn(prompts, responses, **columns)`` that raises, calls ``sys.exit`` or runs past
    ``time_limit`` seconds is a failed call. A failed call over a whole round is retried one
    response at a time, so only the responses it fails on get ``on_failure`` (0 by default) and
    are counted (``failed``, ``timed_out``); it never gets the reward of a success. A function
    that fails on every response it is given (or on the first ``give_up_after`` in a row) is the
    function's bug: the run stops with one line naming it. A call over its time limit is left
    running in a daemon thread (a Python thread cannot be killed) and the run goes on;
    ``max_running`` such calls still running stop the run. After a round's call ran past its limit,
    the one-at-a-time calls share one more limit until one of them succeeds: a function that hangs
    on everything stops the run within about ``2 * time_limit`` (so does one that hangs on the
    round's first response alone; a larger limit gives it more room). ``should_stop()`` (the run's
    SIGINT/SIGTERM) ends a wait at once with :class:`RolloutInterrupted`.

    With ``workers="process"`` the calls run in a worker process instead (:class:`_ProcessWorker`):
    a call past its limit is killed with its process (a new one starts for the next call), so nothing
    is left running; the function must be importable by name (``module:function``), and each call
    pays for sending its arguments and results between processes (``bench/reward_workers_bench.py``).

    Attributes:
        time_limit: seconds one call may take; 0 or None: no limit (a signal still ends the wait).
        on_failure: the reward of a response its call failed on.
        should_stop: a callable, true once the run was asked to stop; None: never.
        workers: ``"thread"`` (default) or ``"process"``.
    """

    time_limit: Optional[float] = 60.0
    on_failure: float = 0.0
    should_stop: Optional[Callable[[], bool]] = None
    give_up_after: int = 4
    max_running: int = 8
    failed: int = 0
    timed_out: int = 0
    workers: str = "thread"
    _running: list = field(default_factory=list, repr=False)
    _process: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.workers not in REWARD_WORKERS:
            raise RolloutError(f"reward_workers must be one of {', '.join(REWARD_WORKERS)}, got {self.workers!r}; "
                               "e.g. --set reward_workers=process (a call past reward_timeout is then killed)")

    def counts(self) -> dict[str, int]:
        return {"reward_failed": self.failed, "reward_timed_out": self.timed_out}

    def close(self) -> None:
        """Stop the worker process, if one runs (a later call starts another)."""
        if self._process is not None:
            self._process.close()
            self._process = None

    def call(self, fn: Callable, args: tuple, kwargs: dict, *, name: str,
             limit: Optional[float] = None) -> tuple[Any, Optional[str]]:
        """``(value, None)``, or ``(None, what went wrong)`` when the call failed; ``limit``: this call's
        seconds, when less than ``time_limit``."""
        seconds = float(self.time_limit) if self.time_limit else math.inf
        seconds = min(seconds, float(limit)) if limit is not None else seconds
        if self.workers == "process":
            if self._process is None or self._process.fn is not fn:
                self.close()
                self._process = _ProcessWorker(fn, name)
            value, error, timed_out = self._process.call(args, kwargs, seconds, self.should_stop)
            self.timed_out += int(timed_out)
            if isinstance(error, BaseException):
                raise error
            return value, error
        self._running = [t for t in self._running if t.is_alive()]
        if len(self._running) >= self.max_running:
            raise RolloutError(f"reward function {name}: {len(self._running)} calls are still running past their "
                               f"time limit of {self.time_limit:g} s; fix the function (it hangs), or raise the "
                               "limit with --set reward_timeout=SECONDS")
        box: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: box.update(zip(("value", "error"), _run_call(fn, args, kwargs))),
                                  name=f"offline-plugins-reward[{name}]", daemon=True)
        worker.start()
        deadline = time.monotonic() + seconds
        while worker.is_alive():
            if self.should_stop is not None and self.should_stop():
                self._running.append(worker)
                raise RolloutInterrupted(f"interrupted while reward function {name} was running; the run stopped "
                                         "there: --resume continues from its last saved checkpoint, if it saved one")
            left = deadline - time.monotonic()
            if left <= 0:
                self._running.append(worker)
                self.timed_out += 1
                return None, f"ran past its time limit of {seconds:g} s"
            worker.join(min(left, 0.05))
        if isinstance(box.get("error"), BaseException):  # one that stops the run (a reward server's)
            raise box["error"]
        return box.get("value"), box.get("error")


#: where a reward function's calls run: a daemon thread of the trainer, or a worker process that is killed
#: with a call past its limit
REWARD_WORKERS = ("thread", "process")


class _ProcessWorker:
    """One worker process (spawned: no state of the trainer's threads or CUDA is copied) that runs ``fn``'s
    calls in order. A call past its seconds, or a signal of the run, kills the process; the next call
    starts a new one. A process that dies (a crash, ``os._exit``) is a failed call."""

    def __init__(self, fn: Callable, name: str) -> None:
        self.fn, self.name = fn, name
        try:
            pickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - pickle raises PicklingError, AttributeError, TypeError
            raise RolloutError(f"reward function {name}: reward_workers=process runs it in another process, which "
                               f"needs it importable by name (a module-level function given as module:function), "
                               f"but it cannot be sent there ({type(exc).__name__}); use reward_workers=thread") from None
        self.proc = None
        self.conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_rewards, args=(child, self.fn, list(sys.path)), daemon=True,
                                name=f"offline-plugins-reward[{self.name}]")
        self.proc.start()
        child.close()

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
            self.proc = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def call(self, args: tuple, kwargs: dict, seconds: float,
             should_stop: Optional[Callable[[], bool]]) -> tuple[Any, Optional[str], bool]:
        """``(value, error, timed_out)``."""
        if self.proc is None or not self.proc.is_alive():
            self.close()
            self._start()
        deadline = time.monotonic() + seconds
        try:
            self.conn.send((args, kwargs))
        except (OSError, ValueError) as exc:  # the arguments cannot be pickled, or the pipe broke
            self.close()
            return None, f"could not be sent to its worker process ({type(exc).__name__}: {str(exc)[:120]})", False
        while True:
            left = deadline - time.monotonic()
            try:
                if self.conn.poll(max(min(left, 0.05), 0)):
                    value, error = self.conn.recv()
                    return value, error, False
            except (EOFError, OSError):
                pass  # the process died mid-call: said below
            if not self.proc.is_alive():
                code = self.proc.exitcode
                self.close()
                return None, f"its worker process exited (code {code}) during the call", False
            if should_stop is not None and should_stop():
                self.close()
                raise RolloutInterrupted(f"interrupted while reward function {self.name} was running (its process "
                                         "was stopped); --resume continues from the last saved checkpoint")
            if left <= 0:
                self.close()  # killed with its process: nothing of the call goes on
                return None, f"ran past its time limit of {seconds:g} s (its worker process was killed)", True


def _serve_rewards(conn, fn: Callable, path: list) -> None:
    """The worker process: answer each ``(args, kwargs)`` with ``_run_call``'s ``(value, error)``."""
    sys.path[:] = path
    while True:
        try:
            args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        value, error = _run_call(fn, args, kwargs)
        try:
            conn.send((value, error))
        except Exception as exc:  # noqa: BLE001 - the value cannot be pickled back
            conn.send((None, f"returned a value that cannot be sent back ({type(exc).__name__})"))


def _run_call(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, Optional[str]]:
    try:
        return fn(*args, **kwargs), None
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:  # a reward function's sys.exit() is a failed call, not the run's end
        return None, f"called sys.exit({exc.code!r})"
    except Exception as exc:  # noqa: BLE001 - the user's function failed: the guard says which and how
        if getattr(exc, "stops_run", False):  # a reward server that cannot be used: no retry (data.remote)
            return None, exc
        return None, f"raised {type(exc).__name__}: {str(exc)[:200]}"


def _checked(name: str, v: Any, i: int, prompt: str, response: str) -> float:
    import torch

    if isinstance(v, bool) or not isinstance(v, (int, float)) and not (torch.is_tensor(v) and v.numel() == 1):
        raise RolloutError(f"reward function {name} returned {v!r:.60} ({type(v).__name__}) for response {i} "
                           f"({response!r:.40} to {prompt!r:.40}); return floats")
    v = float(v)
    if not math.isfinite(v):
        raise RolloutError(f"reward function {name} returned {v} for response {i} ({response!r:.40} to "
                           f"{prompt!r:.40}); rewards must be finite numbers")
    return v


def score_responses(source: PromptSource, rows: Sequence[dict], responses: Sequence[str], *,
                    guard: Optional[RewardGuard] = None) -> list[float]:
    """The source's rewards of ``responses`` to ``rows``, checked: one finite number per response.

    The function is called through ``guard`` (a :class:`RewardGuard`; default: a 60 s limit,
    reward 0 for a failed call): a call that raises, exits or hangs costs the responses it failed
    on their reward, and a function that fails on every response stops the run with one line.
    What a successful call returns must be one finite float per response, in order, or the run
    stops naming the function and the response.
    """
    guard = RewardGuard() if guard is None else guard
    prompts = [r["prompt"] for r in rows]
    columns = {k: [r.get(k) for r in rows] for k in rows[0] if k != "prompt"} if rows else {}
    name = source.reward_name
    values, failure = guard.call(source.reward_fn, (prompts, list(responses)), columns, name=name)
    if failure is None:
        try:
            values = list(values)
        except TypeError:
            raise RolloutError(f"reward function {name} returned a {type(values).__name__}, expected a list of "
                               f"{len(prompts)} floats (one per response)") from None
        if len(values) != len(prompts):
            raise RolloutError(f"reward function {name} returned {len(values)} rewards for {len(prompts)} "
                               "responses; return one float per response, in order")
        return [_checked(name, v, i, prompts[i], responses[i]) for i, v in enumerate(values)]
    # the call over all of them failed: one response at a time, so only those it fails on lose their reward;
    # after a round's call that ran past its limit, the one-at-a-time calls share one more limit until one of
    # them succeeds, so a function that hangs on everything stops the run within about twice reward_timeout
    out: list[float] = []
    failures: list[int] = []
    first = failure
    hung = bool(guard.time_limit) and failure.startswith("ran past its time limit")
    budget_end = time.monotonic() + float(guard.time_limit) if hung else math.inf
    for i in range(len(prompts) if len(prompts) > 1 else 0):
        one = {k: [v[i]] for k, v in columns.items()}
        shared = hung and len(failures) == i  # nothing scored yet: the shared limit holds
        value, failed = guard.call(source.reward_fn, ([prompts[i]], [responses[i]]), one, name=name,
                                   limit=max(budget_end - time.monotonic(), 0.0) if shared else None)
        if failed is None:
            try:
                value = list(value)
            except TypeError:
                failed = f"returned a {type(value).__name__}, not a list"
        if failed is None and len(value) != 1:
            failed = f"returned {len(value)} rewards for 1 response"
        if failed is None:
            out.append(_checked(name, value[0], i, prompts[i], responses[i]))
            continue
        failures.append(i)
        out.append(float(guard.on_failure))
        if len(failures) == i + 1 and (len(failures) >= min(guard.give_up_after, len(prompts))
                                       or (shared and time.monotonic() >= budget_end)):
            break  # it failed on every response so far: four in a row, or hangs past the shared limit
    if len(prompts) == 1:
        failures = [0]
    if len(out) < len(prompts) or len(failures) == len(prompts):
        tried = ("its only response" if len(prompts) == 1 else "every response" if len(failures) == len(prompts)
                 else "the first response" if len(failures) == 1 else f"each of the first {len(failures)} responses")
        raise RolloutError(f"reward function {name} {first} (on prompt {prompts[0]!r:.60} and {len(prompts) - 1} "
                           f"more), and failed on {tried} scored one at a time; fix the function, it is called as "
                           "fn(prompts, responses, **columns) -> list[float]")
    if not failures:  # the round's call failed (e.g. too slow), each response on its own did not
        return out
    guard.failed += len(failures)
    logging.getLogger(__name__).warning(
        "reward function %s failed on %d of %d responses (%s on response %r to %.40r); they got reward %g",
        name, len(failures), len(prompts), first, responses[failures[0]][:40], prompts[failures[0]], guard.on_failure)
    return out


def read_jsonl_rows(path: str, *, what: str, shape: str, check: Callable[[dict], Optional[str]]) -> list[dict]:
    """The rows of a JSONL file, each a JSON object that ``check`` accepts (it returns None, or what is
    wrong); a :class:`RolloutError` naming the file, the line and the expected ``shape`` otherwise, or
    when the file is missing or holds no rows."""
    p = Path(path)
    if not p.is_file():
        raise RolloutError(f"file {str(path)!r} does not exist; give a .jsonl file of {what}")

    rows = []
    for n, row in jsonl_objects(p, error=RolloutError, shape=f"each line must be an object {shape}"):
        wrong = "is not an object" if not isinstance(row, dict) else check(row)
        if wrong:
            raise RolloutError(f"{path}: line {n} {wrong}; each line must be an object {shape}")
        rows.append(row)
    if not rows:
        raise RolloutError(f"{path} holds no rows; it needs {what}")
    return rows


def jsonl_prompt_source(path: str, *, reward: Optional[str] = None, test_fraction: float = 0.1,
                        min_test_rows: int = 100) -> PromptSource:
    """Rows of a JSONL file: ``prompt`` and ``answer`` (exact-match reward), or ``prompt`` (and any
    other columns) with ``reward``, a ``module:function`` reward function."""
    def check(row: dict) -> Optional[str]:
        if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            return "has no non-empty string 'prompt'"
        if reward is None and "answer" not in row:
            return ("has no 'answer'; give prompt/answer rows for the exact-match reward, or a reward function "
                    "with --reward module:function")
        if "answer" in row:
            answer = row["answer"]
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                # str() of a list or an object is text no response writes: 0 reward forever, and exit 0
                return (f"has an 'answer' of type {type(answer).__name__} ({json.dumps(answer)[:40]}); the exact-match "
                        "reward compares text: give the answer as a string or a number (one answer per row)")
            row["answer"] = str(answer)
        return None

    rows = read_jsonl_rows(path, what="prompt/answer rows", shape='{"prompt": ..., "answer": ...}', check=check)
    held = held_out_prompts([r["prompt"] for r in rows], fraction=test_fraction, min_rows=min_test_rows)
    train = [r for r in rows if r["prompt"] not in held]
    test = [r for r in rows if r["prompt"] in held]
    if not train:
        raise RolloutError(f"{path}: every row fell in the held-out split; give more rows")
    fn, name = (_exact_match, "exact match against 'answer'") if reward is None else (load_reward_function(reward),
                                                                                      reward)
    # every distinct prompt: the longest in characters need not be the longest in tokens (a BPE tokenizer's
    # common words are one token each), and the rollout width is sized on the longest in tokens
    longest = sorted({r["prompt"] for r in rows}, key=len)
    return PromptSource(str(path), test, fn, name, train=train, longest_prompts=longest)


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    from offline_plugins.tokens import prompt_token_ids

    return prompt_token_ids(tokenizer, prompt)
