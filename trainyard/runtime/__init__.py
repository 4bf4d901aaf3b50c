"""Processes: torchrun launches, persistent workers, the guardian, multi-machine rendezvous."""
