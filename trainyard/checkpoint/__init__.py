"""Checkpoints: the store layout, the writer and its uploads, verified reads, sharded (DCP)
checkpoints, resume rules and signing."""
