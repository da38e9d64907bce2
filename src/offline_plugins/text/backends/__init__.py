"""The samplers a rollout round draws from: batched generation from a causal LM with the sampled
tokens' log-probs (:mod:`~offline_plugins.text.backends.generation`, ``--generator hf``) and the vLLM
engine (:mod:`~offline_plugins.text.backends.vllm_engine`, ``--generator vllm``, the ``vllm`` extra)."""
