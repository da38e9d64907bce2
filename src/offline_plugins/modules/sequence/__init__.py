"""Networks of the sequence-model algorithms: a small GPT, Decision and Trajectory
Transformer models, Algorithm Distillation's in-context learner, a per-dimension discretiser,
a temporal U-Net and a DDPM schedule."""
