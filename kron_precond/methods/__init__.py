"""Per-layer preconditioning methods. None of them knows about torch.distributed."""
