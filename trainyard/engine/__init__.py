"""What runs inside a torchrun worker: the entry point, jobs, the training loop and what
attaches to it (hooks, tracking, progress, stragglers)."""
