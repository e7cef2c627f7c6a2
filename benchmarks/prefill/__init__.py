"""What the prefill engine costs on this machine: preemption blocking, checkpoints, executor
speed, scheduling rounds, tensor parallelism."""
