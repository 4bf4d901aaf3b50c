"""trainyard engine: pure Python + torch. Never imports prefect (it runs inside torchrun workers)."""

__version__ = "0.1.0"
