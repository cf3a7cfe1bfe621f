"""Moving tensors between ranks and placing per-layer work. Knows nothing of K-FAC or PSGD."""
from kron_precond.distributed.assignment import WorkAssignment, assign_work

__all__ = ["WorkAssignment", "assign_work"]
