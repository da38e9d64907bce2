"""Where prompts and rewards come from: prompt sources (a built-in task, a JSONL file) and reward functions
called under a guard (time limit, failure reward, worker process), :mod:`~offline_plugins.text.sources.prompts`;
a trained reward model as the reward (``--reward DIR``, :mod:`~offline_plugins.text.sources.reward_source`);
the client of a reward or judge server (``--reward http://HOST:PORT``, :mod:`~offline_plugins.text.sources.remote`;
the server is :mod:`offline_plugins.eval.serve`)."""
