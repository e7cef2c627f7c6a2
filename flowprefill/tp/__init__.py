"""Tensor-parallel prefill: one instance as N rank processes on one machine.

:mod:`~flowprefill.tp.shard` splits a checkpoint into rank shards, :mod:`~flowprefill.tp.
agreement` decides where all ranks park, :mod:`~flowprefill.tp.ranks` spawns and commands
the follower ranks, :mod:`~flowprefill.tp.backend` is the engine's view of the instance.
"""
