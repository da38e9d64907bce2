"""TorchRL losses of the sequence-model algorithms: Decision Transformer, Trajectory
Transformer, Diffuser (with its return model) and Algorithm Distillation."""
