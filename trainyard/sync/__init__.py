"""How replicas agree (`train.sync`): DDP's all-reduce every update (trainyard.parallel.wrap,
its cost counted in `communication`), or local SGD and DiLoCo every few (`periodic`). A
parameter server is to live here too."""
