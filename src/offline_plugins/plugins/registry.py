"""Records of what plugins provide, and the registry that holds them.

Records are frozen dataclasses that name their heavy parts (the loss class, the
build function) by import path, so listing algorithms imports no torch.

>>> from dataclasses import dataclass
>>> from offline_plugins.config import config_field
>>> @dataclass
... class AWRConfig:
...     beta: float = config_field(1.0, "advantage temperature")
>>> spec = AlgorithmSpec(
...     name="awr", summary="Advantage-weighted regression", family="offline-rl",
...     data="transitions", loss="my_pkg.losses:AWRLoss", build="my_pkg.glue:build",
...     config=AWRConfig, paper="Peng et al. 2019, arXiv:1910.00177")
>>> registry = Registry()
>>> registry.scoped(provider="my-pkg", version="1.0", plugin="my_pkg").add(spec)
>>> registry.algorithm("awr").provider
'my-pkg'
>>> registry.algorithm("awq")
Traceback (most recent call last):
...
offline_plugins.plugins.registry.UnknownNameError: unknown algorithm 'awq'; did you mean 'awr'?
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

from offline_plugins.config import describe_config
from offline_plugins.errors import UserError
from offline_plugins.plugins.datakind import DataKind
from offline_plugins.plugins.hookspecs import hookimpl

__all__ = [
    "FAMILIES",
    "DATA_KINDS",
    "AlgorithmSpec",
    "DatasetSpec",
    "JudgeSpec",
    "SandboxSpec",
    "TextTaskSpec",
    "ToolSpec",
    "RewardSpec",
    "Registry",
    "ScopedRegistrar",
    "BrokenPlugin",
    "DuplicateNameError",
    "UnknownNameError",
    "PluginError",
    "resolve",
    "builtin_algorithm",
    "builtin_sequence_model",
    "builtin_hook",
]

Family = Literal["offline-rl", "sequence-model", "preference", "online-llm"]
DataKindName = Literal["transitions", "trajectories", "preference-pairs", "unpaired-feedback", "text-rollouts"]
FAMILIES: tuple[str, ...] = ("offline-rl", "sequence-model", "preference", "online-llm")
DATA_KINDS: tuple[str, ...] = (
    "transitions",
    "trajectories",
    "preference-pairs",
    "unpaired-feedback",
    "text-rollouts",
)
ACTION_SPACES: tuple[str, ...] = ("continuous", "discrete", "tokens")


class PluginError(UserError):
    """Base class of the errors the plugin host raises."""


class DuplicateNameError(PluginError):
    """Two plugins registered the same name."""


class UnknownNameError(PluginError, KeyError):
    """A name no installed plugin registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0] if self.args else ""


def resolve(ref: Union[str, Callable, type]) -> Any:
    """Import ``"package.module:Qualified.name"``; anything else is returned as is."""
    if not isinstance(ref, str):
        return ref
    module_name, sep, qualname = ref.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"import path {ref!r} must look like 'package.module:Name'")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _check_choice(owner: str, what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {what} {value!r} is not one of {', '.join(choices)}")


def import_path(ref: Union[str, Callable, type]) -> str:
    """``ref`` as the import path :func:`resolve` takes back (``"package.module:Qualified.name"``); a string
    as it is.

    >>> import_path(import_path)
    'offline_plugins.plugins.registry:import_path'
    """
    return ref if isinstance(ref, str) else f"{ref.__module__}:{ref.__qualname__}"


def provenance(record: Any) -> dict[str, Any]:
    """Who registered ``record`` (the stamp ``registry.add`` puts on it): ``provider`` (the
    distribution), ``version`` and ``plugin`` (the entry point's or built-in module's name)."""
    return {"provider": record.provider, "version": record.version, "plugin": record.plugin}


@dataclass(frozen=True)
class AlgorithmSpec:
    """An algorithm a plugin provides.

    Attributes:
        name: the unique, lower-case name users type (``offline-plugins train NAME``).
        summary: one line.
        family: ``offline-rl``, ``sequence-model``, ``preference`` or ``online-llm``.
        data: the data kind it reads (:class:`~offline_plugins.kinds.DataKind`): built in
            are ``transitions``, ``trajectories``, ``preference-pairs`` and
            ``unpaired-feedback``; ``text-rollouts`` is reserved for online LLM training;
            a plugin may register others.
        loss: the TorchRL ``LossModule`` class, or its import path ``"pkg.mod:Class"``.
        build: ``build(config, data) -> parts``, or its import path.
        config: a dataclass whose fields (made with
            :func:`offline_plugins.config.config_field`) hold the reference defaults.
        paper: citation of the method.
        action_spaces: the action spaces it supports (``continuous``, ``discrete``,
            ``tokens``); empty means any.
        experimental: why the method is not yet shown to do what its paper says on a task
            this package can run (one sentence, pointing at docs/results-history.md); empty when it
            is. ``list`` marks it, ``info`` prints the reason, ``train`` warns.
        provider: distribution that registered it (filled in by the host).
        version: that distribution's version (filled in by the host).
        plugin: the plugin name (what ``OFFLINE_PLUGINS_DISABLE`` takes).
    """

    name: str
    summary: str
    family: Family
    data: str  # a DataKindName, or a kind a plugin registers
    loss: Union[str, type]
    build: Union[str, Callable]
    config: type
    paper: str = ""
    action_spaces: tuple[str, ...] = ()
    experimental: str = ""
    provider: str = ""
    version: str = ""
    plugin: str = ""

    def __post_init__(self) -> None:
        owner = f"AlgorithmSpec {self.name!r}"
        if not self.name or self.name != self.name.strip().lower() or " " in self.name:
            raise ValueError(f"{owner}: name must be a non-empty lower-case word, e.g. 'iql'")
        _check_choice(owner, "family", self.family, FAMILIES)
        if not isinstance(self.data, str) or not self.data or self.data != self.data.strip().lower() or " " in self.data:
            raise ValueError(
                f"{owner}: data must name a data kind, a lower-case word such as {', '.join(map(repr, DATA_KINDS))} "
                f"or one a plugin registers; got {self.data!r}"
            )
        for a in self.action_spaces:
            _check_choice(owner, "action space", a, ACTION_SPACES)
        if not dataclasses.is_dataclass(self.config):
            raise ValueError(f"{owner}: config must be a dataclass type, got {self.config!r}")

    def load_loss_class(self) -> type:
        """The loss class (imports it on first use)."""
        return resolve(self.loss)

    def load_build(self) -> Callable:
        """The build function (imports it on first use)."""
        return resolve(self.build)

    def default_config(self) -> Any:
        return self.config()

    @property
    def loss_path(self) -> str:
        if isinstance(self.loss, str):
            return self.loss
        return f"{self.loss.__module__}:{self.loss.__qualname__}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary,
            "family": self.family,
            "data": self.data,
            "action_spaces": list(self.action_spaces),
            "loss": self.loss_path,
            "paper": self.paper,
            "experimental": self.experimental or None,
            **provenance(self),
            "config": describe_config(self.config),
        }


def builtin_algorithm(
    name: str,
    summary: str,
    config: type,
    paper: str,
    *,
    loss: str,
    build: str,
    family: str = "offline-rl",
    data: str = "transitions",
    action_space: str = "continuous",
    experimental: str = "",
) -> AlgorithmSpec:
    """The :class:`AlgorithmSpec` of an algorithm this package ships: ``loss`` and ``build`` are
    import paths relative to ``offline_plugins.objectives`` and ``offline_plugins.algorithms``,
    and it supports the one ``action_space``.

    >>> from offline_plugins.algorithms.iql import IQLConfig
    >>> spec = builtin_algorithm("iql", "Implicit Q-Learning", IQLConfig, "", loss="iql:IQLLoss", build="iql:build")
    >>> spec.loss, spec.build, spec.family, spec.data, spec.action_spaces
    ('offline_plugins.objectives.iql:IQLLoss', 'offline_plugins.algorithms.iql:build', 'offline-rl', 'transitions', ('continuous',))
    """
    return AlgorithmSpec(
        name=name,
        summary=summary,
        family=family,
        data=data,
        loss=f"offline_plugins.objectives.{loss}",
        build=f"offline_plugins.algorithms.{build}",
        config=config,
        paper=paper,
        action_spaces=(action_space,),
        experimental=experimental,
    )



def builtin_sequence_model(name: str, summary: str, config: type, paper: str, *, loss: str, build: str,
                           experimental: str = "") -> AlgorithmSpec:
    """:func:`builtin_algorithm` for a sequence model this package ships (family ``sequence-model``,
    trained on ``trajectories``): ``loss`` and ``build`` are relative to
    ``offline_plugins.objectives.sequence`` and ``offline_plugins.algorithms.sequence``.

    >>> from offline_plugins.algorithms.sequence.dt import DTConfig
    >>> spec = builtin_sequence_model("dt", "DT", DTConfig, "", loss="decision_transformer:DecisionTransformerLoss",
    ...                               build="dt:build")
    >>> spec.loss, spec.build, spec.family, spec.data
    ('offline_plugins.objectives.sequence.decision_transformer:DecisionTransformerLoss', 'offline_plugins.algorithms.sequence.dt:build', 'sequence-model', 'trajectories')
    """
    return builtin_algorithm(name, summary, config, paper, loss=f"sequence.{loss}", build=f"sequence.{build}",
                             family="sequence-model", data="trajectories", experimental=experimental)


def builtin_hook(*specs: AlgorithmSpec) -> Callable:
    """The ``offline_plugins_register_algorithms`` hook implementation of a glue module that
    ships ``specs`` (:func:`builtin_algorithm`); the module binds it to that name, where
    pluggy looks for it.

    >>> from offline_plugins.algorithms.iql import IQLConfig
    >>> hook = builtin_hook(builtin_algorithm("iql", "Implicit Q-Learning", IQLConfig, "", loss="iql:IQLLoss",
    ...                                       build="iql:build"))
    >>> registry = Registry()
    >>> hook(registry.scoped("offline-plugins", "0", "iql"))
    >>> sorted(registry.algorithms), hook.__name__
    (['iql'], 'offline_plugins_register_algorithms')
    """
    @hookimpl
    def offline_plugins_register_algorithms(registry):
        for spec in specs:
            registry.add(spec)

    return offline_plugins_register_algorithms

def builtin_text_algorithm(name: str, summary: str, config: type, paper: str, *, loss: str, build: str,
                           data: str = "text-rollouts", experimental: str = "") -> AlgorithmSpec:
    """:func:`builtin_algorithm` for an LLM algorithm this package ships that trains on text it samples
    (family ``online-llm``, token actions): ``loss`` is relative to ``offline_plugins.objectives.llm``
    and ``build`` to ``offline_plugins.algorithms``.

    >>> from offline_plugins.algorithms.online import GRPOConfig
    >>> spec = builtin_text_algorithm("grpo", "GRPO", GRPOConfig, "", loss="online:TextGRPOLoss", build="online:build_grpo")
    >>> spec.loss, spec.build, spec.family, spec.data, spec.action_spaces
    ('offline_plugins.objectives.llm.online:TextGRPOLoss', 'offline_plugins.algorithms.online:build_grpo', 'online-llm', 'text-rollouts', ('tokens',))
    """
    return builtin_algorithm(name, summary, config, paper, loss=f"llm.{loss}", build=build, family="online-llm",
                             data=data, action_space="tokens", experimental=experimental)


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset recipe a plugin provides: how to make a Minari dataset locally.

    Attributes:
        id: the Minari dataset id it makes, e.g. ``"pendulum/medium-v0"``.
        summary: one line.
        env_id: the Gymnasium id of its environment.
        make: ``make(spec, *, seed, progress, **kwargs) -> minari.MinariDataset``, or
            its import path.
        tier: ``random``, ``medium``, ``medium-replay``, ``expert``, ``medium-expert``
            or another label.
        action_space: ``continuous`` or ``discrete``.
        requires: extras it needs (``("mujoco",)``), shown when missing.
        options: recipe parameters (episode counts, policy file), passed to ``make``.
        provider, version, plugin: filled in by the host.
    """

    id: str
    summary: str
    env_id: str
    make: Union[str, Callable]
    tier: str = ""
    action_space: str = "continuous"
    requires: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()
    provider: str = ""
    version: str = ""
    plugin: str = ""

    def __post_init__(self) -> None:
        if not self.id or " " in self.id:
            raise ValueError(f"DatasetSpec: id must be a Minari id like 'pendulum/medium-v0', got {self.id!r}")
        _check_choice(f"DatasetSpec {self.id!r}", "action space", self.action_space, ACTION_SPACES)

    @property
    def name(self) -> str:
        return self.id

    def load_make(self) -> Callable:
        return resolve(self.make)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "summary": self.summary,
            "env_id": self.env_id,
            "tier": self.tier,
            "action_space": self.action_space,
            "requires": list(self.requires),
            "options": dict(self.options),
            **provenance(self),
        }


def _check_word(spec: str, what: str, name: str) -> None:
    """A name given on the command line: a lower-case word without spaces or ':'."""
    if not name or name != name.strip().lower() or " " in name or ":" in name:
        raise ValueError(f"{spec}: a {what}'s name must be a lower-case word without ':', got {name!r}")


@dataclass(frozen=True)
class JudgeSpec:
    """An AI judge a plugin provides: ``--judge NAME`` (online DPO, ``data label``, ``data audit``).

    Attributes:
        name: what ``--judge`` takes, a lower-case word.
        summary: one line.
        judge: a :class:`~offline_plugins.eval.judge.Judge` subclass (built with its defaults) or a
            function ``f(prompt, first, second) -> P(first shown is better)``, or its import path.
        provider, version, plugin: filled in by the host.
    """

    name: str
    summary: str
    judge: Union[str, Callable, type]
    provider: str = ""
    version: str = ""
    plugin: str = ""

    def __post_init__(self) -> None:
        _check_word("JudgeSpec", "judge", self.name)

    def load(self) -> Any:
        return resolve(self.judge)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "summary": self.summary, "judge": import_path(self.judge), **provenance(self)}


@dataclass(frozen=True)
class TextTaskSpec:
    """A text task a plugin provides: an id ``--dataset`` takes for the algorithms trained on their
    own rollouts (``grpo`` ...), with its short aliases.

    Attributes:
        id: the canonical id, ``namespace/name/vN`` (``offline-plugins/arithmetic/v0``).
        summary: one line: the prompts and the reward.
        task: the task's factory (a class or a function, or its import path), called with
            ``settings`` as keyword arguments; what it returns is a task of
            :mod:`offline_plugins.text.tasks`' shape (``problems``, ``rewards``, ``name``).
        settings: keyword arguments of ``task``, as ``(key, value)`` pairs.
        aliases: other names of the id (``arithmetic``, ``arithmetic/v0``).
        provider, version, plugin: filled in by the host.

    >>> TextTaskSpec("me/reverse/v0", "reverse a word", "my_plugin:ReverseTask", aliases=("reverse",)).name
    'me/reverse/v0'
    """

    id: str
    summary: str
    task: Union[str, Callable]
    settings: tuple[tuple[str, Any], ...] = ()
    aliases: tuple[str, ...] = ()
    provider: str = ""
    version: str = ""
    plugin: str = ""

    def __post_init__(self) -> None:
        if not self.id or " " in self.id or self.id.count("/") < 1 or self.id.endswith(".jsonl"):
            raise ValueError(f"TextTaskSpec: id must look like 'namespace/name/v0', got {self.id!r}")

    @property
    def name(self) -> str:
        return self.id

    def make(self) -> Any:
        """The task, built by its factory with its settings."""
        return resolve(self.task)(**dict(self.settings))

    def to_dict(self) -> dict[str, Any]:
        task = import_path(self.task)
        return {"id": self.id, "summary": self.summary, "task": task, "settings": dict(self.settings),
                "aliases": list(self.aliases), **provenance(self)}


@dataclass(frozen=True)
class ToolSpec:
    """A tool a plugin provides for multi-turn episodes: the name a policy calls it by
    (``<tool name="NAME">...</tool>``) and a task's ``tools`` setting takes.

    Attributes:
        name: a lower-case word.
        summary: one line: what a call does.
        tool: a :class:`~offline_plugins.text.tools.tools.Tool` subclass or factory (or its import path),
            called with those of ``timeout`` (seconds a call may take) and ``sandbox`` (the registered
            sandbox's name, for a tool that runs model-written code) that it takes.
        provider, version, plugin: filled in by the host.
    """

    name: str
    summary: str
    tool: Union[str, Callable, type]
    provider: str = ""
    version: str = ""
    plugin: str = ""

    def __post_init__(self) -> None:
        _check_word("ToolSpec", "tool", self.name)

    def make(self, *, timeout: float = 5.0, sandbox: Optional[str] = None) -> Any:
        """The tool, built with the settings its factory takes."""
        factory = resolve(self.tool)
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            params = {}
        kwargs = {k: v for k, v in (("timeout", timeout), ("sandbox", sandbox)) if k in params}
        return factory(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "summary": self.summary, "tool": import_path(self.tool), **provenance(self)}


@dataclass(frozen=True)
class RewardSpec:
    """A reward function a plugin provides: ``--reward NAME`` (or ``--reward KEY=NAME`` among several)
    scores the responses of the algorithms trained on their own rollouts with it.

    Attributes:
        name: what ``--reward`` takes, a lower-case word without ':'.
        summary: one line: what it rewards.
        function: ``f(prompts, responses, **columns) -> list[float]`` (or its import path).
        provider, version, plugin: filled in by the host.
    """

    name: str
    summary: str
    function: Union[str, Callable]
    provider: str = ""
    version: str = ""
    plugin: str = ""

    def __post_init__(self) -> None:
        _check_word("RewardSpec", "reward", self.name)

    def load(self) -> Callable:
        """The reward function."""
        return resolve(self.function)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "summary": self.summary, "function": import_path(self.function), **provenance(self)}


@dataclass(frozen=True)
class SandboxSpec:
    """A sandbox a plugin provides for tools that run model-written code: ``--set tool_sandbox=NAME``.

    Attributes:
        name: what ``tool_sandbox`` takes, a lower-case word (``-`` allowed).
        summary: one line: what it isolates.
        sandbox: a :class:`~offline_plugins.text.tools.sandbox.Sandbox` subclass (built with its defaults) or
            instance, or its import path.
        provider, version, plugin: filled in by the host.
    """

    name: str
    summary: str
    sandbox: Union[str, Callable, type, Any]
    provider: str = ""
    version: str = ""
    plugin: str = ""

    def __post_init__(self) -> None:
        _check_word("SandboxSpec", "sandbox", self.name)

    def load(self) -> Any:
        return resolve(self.sandbox) if isinstance(self.sandbox, str) else self.sandbox

    def to_dict(self) -> dict[str, Any]:
        made = self.sandbox if isinstance(self.sandbox, (str, type)) else type(self.sandbox)
        return {"name": self.name, "summary": self.summary, "sandbox": import_path(made), **provenance(self)}


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin that failed to import or to register; the others still load."""

    plugin: str
    provider: str
    version: str
    stage: str  # "import", "register" or "duplicate"
    error: str

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


#: the record classes a plugin registers, the registry table each goes in, and what messages call it
_RECORDS = ((AlgorithmSpec, "algorithms", "algorithm"), (DatasetSpec, "datasets", "dataset"),
            (JudgeSpec, "judges", "judge"), (SandboxSpec, "sandboxes", "sandbox"),
            (TextTaskSpec, "text_tasks", "text task"), (ToolSpec, "tools", "tool"), (RewardSpec, "rewards", "reward"))


@dataclass
class Registry:
    """Algorithms and dataset recipes by name, with the plugins that failed to load."""

    algorithms: dict[str, AlgorithmSpec] = field(default_factory=dict)
    datasets: dict[str, DatasetSpec] = field(default_factory=dict)
    data_kinds: dict[str, Any] = field(default_factory=dict)  # name -> DataKind
    judges: dict[str, JudgeSpec] = field(default_factory=dict)
    sandboxes: dict[str, SandboxSpec] = field(default_factory=dict)
    text_tasks: dict[str, TextTaskSpec] = field(default_factory=dict)
    tools: dict[str, ToolSpec] = field(default_factory=dict)
    rewards: dict[str, RewardSpec] = field(default_factory=dict)
    broken: list[BrokenPlugin] = field(default_factory=list)
    plugins: dict[str, tuple[str, str]] = field(default_factory=dict)  # plugin -> (provider, version)
    disabled: set[str] = field(default_factory=set)  # plugin names switched off by the user

    def scoped(self, provider: str, version: str, plugin: str) -> "ScopedRegistrar":
        """A registrar that stamps every record it adds with this provider."""
        return ScopedRegistrar(self, provider, version, plugin)

    def _add(self, spec: Union[AlgorithmSpec, DatasetSpec, Any]) -> None:
        table, kind = self._table_of(spec)
        if isinstance(spec, TextTaskSpec):
            taken = {a: t for t in self.text_tasks.values() for a in (t.id, *t.aliases)}
            clash = next((a for a in (spec.id, *spec.aliases) if a in taken and taken[a].id != spec.id), None)
            if clash is not None:
                raise DuplicateNameError(
                    f"text task name {clash!r} is registered twice: by {_who(taken[clash])} and by {_who(spec)}; "
                    f"uninstall one, or switch one plugin off with OFFLINE_PLUGINS_DISABLE={spec.plugin}")
        elif isinstance(spec, DataKind):
            if not spec.name or spec.name != spec.name.strip().lower() or " " in spec.name:
                raise ValueError(f"{type(spec).__name__}: a data kind's name must be a lower-case word, "
                                 f"got {spec.name!r}")
        old = table.get(spec.name)
        if old is not None:
            raise DuplicateNameError(
                f"{kind} name {spec.name!r} is registered twice: by {_who(old)} and by {_who(spec)}; "
                f"uninstall one, or switch one plugin off with OFFLINE_PLUGINS_DISABLE={spec.plugin or old.plugin}"
            )
        table[spec.name] = spec

    def _table_of(self, spec: Any) -> tuple[dict, str]:
        """The table a record goes in and what it is called in messages; a TypeError for anything else."""
        for cls, attr, kind in _RECORDS:
            if isinstance(spec, cls):
                return getattr(self, attr), kind
        if isinstance(spec, DataKind):
            return self.data_kinds, "data kind"
        raise TypeError(f"registry.add expects one of {', '.join(c.__name__ for c, _, _ in _RECORDS)} or a DataKind, "
                        f"got {type(spec).__name__}")

    def algorithm(self, name: str) -> AlgorithmSpec:
        """The spec called ``name``; an unknown name raises with close matches."""
        return self._lookup(self.algorithms, name, "algorithm")

    def dataset(self, name: str) -> DatasetSpec:
        return self._lookup(self.datasets, name, "dataset")

    def judge(self, name: str) -> JudgeSpec:
        """The :class:`JudgeSpec` called ``name``; an unknown name raises with close matches."""
        return self._lookup(self.judges, name, "judge")

    def sandbox(self, name: str) -> SandboxSpec:
        """The :class:`SandboxSpec` called ``name``; an unknown name raises with close matches."""
        return self._lookup(self.sandboxes, name, "sandbox")

    def text_task(self, name: str) -> TextTaskSpec:
        """The :class:`TextTaskSpec` whose id or alias is ``name``; an unknown name raises with close matches."""
        found = self.resolve_text_task(name)
        return self.text_tasks[found] if found is not None else self._lookup(self.text_tasks, name, "text task")

    def resolve_text_task(self, name: str) -> Optional[str]:
        """The id of the text task called ``name`` (its id or an alias), or None."""
        name = name.strip()
        for spec in self.text_tasks.values():
            if name == spec.id or name in spec.aliases:
                return spec.id
        return None

    def tool(self, name: str) -> ToolSpec:
        """The :class:`ToolSpec` called ``name``; an unknown name raises with close matches."""
        return self._lookup(self.tools, name, "tool")

    def reward(self, name: str) -> RewardSpec:
        """The :class:`RewardSpec` called ``name``; an unknown name raises with close matches."""
        return self._lookup(self.rewards, name, "reward")

    def data_kind(self, name: str):
        """The :class:`~offline_plugins.kinds.DataKind` called ``name``; an unknown name raises."""
        return self._lookup(self.data_kinds, name, "data kind")

    def kind_of(self, spec: AlgorithmSpec):
        """The data kind ``spec`` reads; raises naming the algorithm when no plugin provides it."""
        if spec.data in self.data_kinds:
            return self.data_kinds[spec.data]
        installed = ", ".join(sorted(self.data_kinds)) or "none"
        off = (f" (plugins switched off by OFFLINE_PLUGINS_DISABLE or --disable: {', '.join(sorted(self.disabled))})"
               if self.disabled else "")
        raise UnknownNameError(
            f"algorithm {spec.name!r} reads {spec.data} data, which no installed plugin provides, so 'train' cannot "
            f"give it any{off}; installed data kinds: {installed}. Install the plugin that provides it, or pick "
            "another algorithm ('offline-plugins list')"
        )

    def _lookup(self, table: dict, name: str, kind: str):
        if name in table:
            return table[name]
        key = name.strip().lower()
        if key in table:
            return table[key]
        close = difflib.get_close_matches(key, list(table), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        broken = [b for b in self.broken if key in b.plugin.lower() or key in b.error.lower()]
        if broken:
            b = broken[0]
            hint += f" (plugin {b.plugin!r} from {b.provider} failed to load: {b.error})"
        if not hint:
            hint = f"; installed: {', '.join(sorted(table)) or 'none'}"
        if self.disabled:
            hint += f" (plugins switched off by OFFLINE_PLUGINS_DISABLE or --disable: {', '.join(sorted(self.disabled))})"
        raise UnknownNameError(f"unknown {kind} {name!r}{hint}")


def _who(spec: Union[AlgorithmSpec, DatasetSpec]) -> str:
    who = spec.provider or "an unnamed provider"
    if spec.version:
        who += f" {spec.version}"
    if spec.plugin:
        who += f" (plugin {spec.plugin!r})"
    return who


@dataclass
class ScopedRegistrar:
    """What a hook receives: ``registry.add(spec)`` stamps the provider and checks names."""

    registry: Registry
    provider: str
    version: str
    plugin: str
    added: list = field(default_factory=list)

    def add(self, spec: Union[AlgorithmSpec, DatasetSpec, Any]) -> None:
        if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
            spec = dataclasses.replace(
                spec,
                provider=spec.provider or self.provider,
                version=spec.version or self.version,
                plugin=self.plugin,
            )
        else:  # a DataKind instance: stamp a copy

            spec = copy.copy(spec)
            spec.provider = getattr(spec, "provider", "") or self.provider
            spec.version = getattr(spec, "version", "") or self.version
            spec.plugin = self.plugin
        self.registry._add(spec)
        self.added.append(spec)

    def rollback(self) -> None:
        """Remove what this registrar added (its plugin failed part-way)."""
        for spec in self.added:
            table, _ = self.registry._table_of(spec)
            if table.get(spec.name) is spec:
                del table[spec.name]
        self.added.clear()
