"""The text stack: everything between a prompt and a scored, tokenised rollout row.

Laid out as TorchRL's LLM stack is (``torchrl.envs.llm`` with its tools, ``torchrl.modules.llm.backends``,
``torchrl.collectors.llm``, ``torchrl.data.llm``), one subpackage a layer; a layer imports only the
layers listed before it (``tests/test_import_rule.py`` checks it):

- :mod:`~offline_plugins.text.tools`: the tools a multi-turn episode calls (calculator, Python), the
  sandboxes code runs in, and how an episode goes on after a turn (``MultiTurn``).
- :mod:`~offline_plugins.text.tasks`: the verifiable tasks (problem makers with their verifiers:
  arithmetic, word problems, step chains, the tool tasks), their catalog ``make_task`` and the task ids
  the registry holds. Pure Python.
- :mod:`~offline_plugins.text.envs`: ``TextEnv`` (prompt = state, response = action, a TorchRL
  ``EnvBase``; its ``step`` is the whole response, or one turn of a multi-turn episode) and the
  Gymnasium view of a task.
- :mod:`~offline_plugins.text.backends`: the samplers: batched generation from a transformers model,
  the vLLM engine.
- :mod:`~offline_plugins.text.sources`: where prompts and rewards come from: prompt sources, reward
  functions called under a guard, a trained reward model, a reward or judge server over HTTP.
- :mod:`~offline_plugins.text.collectors`: the rollout collector (a round: reset, sample, step until the
  episodes end, score, write TED rows; one per run), the sampler process of overlapped rounds and the
  live check that a sampler holds the trainer's weights.
- :mod:`~offline_plugins.text.data`: what a run loads: a task's prompts, reward, reference and sampling
  settings (``RolloutData``), its SFT rows, samples and preference pairs; preference pairs from any
  source and step-labelled solutions, as TensorDicts.

The round's place in training (the data module, the evaluation, the reward-hacking monitor) is the
``text-rollouts`` kind's, in :mod:`offline_plugins.kinds.rollouts`. Importing this package imports no
torch.
"""
