"""Tensor-parallel prefill: one instance as N rank processes on one machine.

:mod:`~flowprefill.prefill.tp.shard` splits a checkpoint into rank shards,
:mod:`~flowprefill.prefill.tp.agreement` decides where all ranks park,
:mod:`~flowprefill.prefill.tp.ranks` spawns and commands the follower ranks,
:mod:`~flowprefill.prefill.tp.prefill_backend` is the engine's prefill backend on rank 0.
"""
