"""The rollout round: :class:`~offline_plugins.text.collectors.collector.RolloutCollector` (reset the text
environment, sample, step it until the episodes end, score, write TED text rows; one per run), episodes
outside a round (:mod:`~offline_plugins.text.collectors.multiturn`: given prompts, sampled or greedy), the
sampler process of overlapped rounds (:mod:`~offline_plugins.text.collectors.async_sampler`) and the check
that a sampler holds the trainer's weights (:mod:`~offline_plugins.text.collectors.sync_check`)."""
