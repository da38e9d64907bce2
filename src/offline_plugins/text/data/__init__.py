"""What a text run loads: a task's prompts, reward, frozen reference and sampling settings, and the
completion rows of SFT (:mod:`~offline_plugins.text.data.rollouts`); a task's SFT rows, samples,
preference pairs and its cached SFT reference (:mod:`~offline_plugins.text.data.task_data`); preference
pairs from any source (a built-in task, a JSONL file, a hub dataset), tokenised into TensorDicts
(:mod:`~offline_plugins.text.data.preference_sources`, :mod:`~offline_plugins.text.data.preference`);
step-labelled solutions for process reward models (:mod:`~offline_plugins.text.data.steps`)."""
