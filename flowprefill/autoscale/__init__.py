"""Autoscaling decisions shared by the operator and the simulator (:mod:`.policy`)."""
