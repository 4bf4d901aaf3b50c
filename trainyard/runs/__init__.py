"""A run's life in the store: its record, lease, continuation, the contracts its jobs hand
back, and the checks before anything is launched."""
