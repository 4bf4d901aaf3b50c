"""How a model is spread over workers: DDP and FSDP today; pipeline, tensor and device
meshes next."""
