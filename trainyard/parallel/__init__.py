"""How a model is spread over workers: DDP, FSDP, tensor and pipeline parallelism."""
