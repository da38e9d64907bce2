"""The networks and model wrappers the losses train: MLP actors and critics (``networks``, ``policies``),
flow policies (``flow``), sequence models (``sequence``), causal LMs' log-probs and rewards
(``causal_lm``), batched generation (``generation``), the built-in language models (``tiny_lm``,
``small_lm``, ``task_text``) and the vLLM engine as a sampler (``vllm_engine``)."""
