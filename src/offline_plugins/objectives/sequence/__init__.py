"""TorchRL losses of the sequence-model algorithms: Decision Transformer, Trajectory
Transformer and Diffuser (with its return model)."""
