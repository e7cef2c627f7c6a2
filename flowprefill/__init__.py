"""FlowPrefill: SLO-aware prefill serving with operator-level preemption."""

__version__ = "0.1.0"
