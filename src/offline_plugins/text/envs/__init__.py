"""Text environments: :class:`~offline_plugins.text.envs.text.TextEnv` (prompt = state, response = action;
one step an episode, or one turn of a multi-turn episode with tools, whose state between turns is
:class:`~offline_plugins.text.envs.turns.Turns`) and the Gymnasium view of a task
(:mod:`~offline_plugins.text.envs.gym_text`)."""
