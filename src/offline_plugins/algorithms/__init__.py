"""The algorithms as plugins: one glue module per family, each a config dataclass, a
``build(config, data) -> AlgorithmParts`` and a ``@hookimpl`` registering its ``AlgorithmSpec``.

Offline RL (``bc``, ``bcq``, ``iql``, ``cql``, ``awac``, ``td3_bc``, ``edac``, ``rebrac``, ``cal_ql``,
``fql``), the sequence models (``sequence/``: ``dt``, ``odt``, ``tt``, ``diffuser``, ``ad``), preference
optimisation and reward models (``preference``), the online text algorithms (``online``, ``online_dpo``,
``ppo_rlhf``, ``text_dt``), process reward models (``prm``, ``prm_rl``) and distillation (``distill``);
``base`` holds ``AlgorithmParts``, ``llm`` what the language-model families share, ``_glue`` what the
environment families share. Importing a glue module imports no torch (``offline-plugins list`` reads the
configs); ``build`` imports the losses and networks it needs.
"""
