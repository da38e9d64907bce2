"""The networks and model wrappers the losses train: MLP actors and critics (``networks``, ``policies``),
flow policies (``flow``), sequence models (``sequence``), causal LMs' log-probs and rewards
(``causal_lm``) and the built-in language models (``tiny_lm``, ``small_lm``, ``task_text``). The
samplers (batched generation, the vLLM engine) are :mod:`offline_plugins.text.backends`."""

