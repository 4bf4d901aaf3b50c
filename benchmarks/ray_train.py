"""Ray Train's TorchTrainer doing the same job as the raw script: same model, data, batch and
workers; trained, checkpointed (ray.train.Checkpoint) and validated on the test split.

    python benchmarks/ray_train.py --data DIR --out result.json --workers 2 --epochs 5
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def train_loop(config):
    import numpy as np
    import torch
    import torch.nn.functional as F
    from ray import train
    from torch import nn

    def load(name):
        schema = config["schema"]
        x = torch.from_numpy(np.load(f"{config['data']}/{name}_x.npy"))
        x = (x - torch.tensor(schema["feature_mean"])) / torch.tensor(schema["feature_std"])
        return x, torch.from_numpy(np.load(f"{config['data']}/{name}_y.npy"))

    torch.set_num_threads(1)
    rank, world = train.get_context().get_world_rank(), train.get_context().get_world_size()
    x, y = load("train")
    torch.manual_seed(0)
    model = train.torch.prepare_model(
        nn.Sequential(
            nn.Linear(x.shape[1], 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
        )
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * world, momentum=0.9)
    first_step_at = None
    for epoch in range(config["epochs"]):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        shard = order[rank::world]
        for step in range(len(order) // (32 * world)):
            idx = shard[step * 32 : (step + 1) * 32]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            first_step_at = first_step_at or time.time()
    tx, ty = load("test")
    with torch.no_grad():
        accuracy = (model(tx).argmax(1) == ty).float().mean().item()
    with tempfile.TemporaryDirectory() as folder:
        torch.save(model.state_dict(), os.path.join(folder, "model.pt"))
        train.report(
            {"first_step_at": first_step_at, "test_accuracy": accuracy},
            checkpoint=train.Checkpoint.from_directory(folder),
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={
                "data": args.data,
                "epochs": args.epochs,
                "schema": json.loads(Path(args.data, "schema.json").read_text()),
            },
            scaling_config=ScalingConfig(
                num_workers=args.workers, use_gpu=False, resources_per_worker={"CPU": 1}
            ),
            run_config=RunConfig(storage_path=storage, name="bench"),
        )
        result = trainer.fit()
    ray.shutdown()
    Path(args.out).write_text(json.dumps({**result.metrics, "finished_at": time.time()}))


if __name__ == "__main__":
    main()
