"""Simulator studies: the paper's figures, admission, autoscaling, bounded blocking, tensor
parallelism, and the simulator checked against the real engine."""
