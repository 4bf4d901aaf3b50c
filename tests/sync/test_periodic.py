"""The periodic sync's arithmetic on real gloo workers: local SGD's replicas end every
interval on their exact mean, DiLoCo's on the outer Nesterov step of that mean's change, and
the bytes and syncs it reports are the collectives it ran."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from trainyard.sync.periodic import OuterSettings, PeriodicSync


def _replica(rank: int) -> nn.Sequential:
    """The same layer on each rank, moved apart as inner steps would move it."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(2)
    model = nn.Sequential(nn.Linear(3, 2), norm)
    with torch.no_grad():
        for tensor in [*model.parameters(), _running_mean(model)]:
            tensor.add_(float(rank + 1))
    return model


def _running_mean(model: nn.Sequential) -> torch.Tensor:
    running = model[1].running_mean
    assert isinstance(running, torch.Tensor)
    return running


def _outer_by_hand(start: list[torch.Tensor], means: list[torch.Tensor], lr, mu, momenta):
    """Nesterov SGD (torch's form) on the pseudo-gradient start - mean."""
    stepped = []
    for i, (s, m) in enumerate(zip(start, means, strict=True)):
        g = s - m
        momenta[i] = g.clone() if momenta[i] is None else mu * momenta[i] + g
        stepped.append(s - lr * (g + mu * momenta[i]))
    return stepped


def _check_agreed_weights(
    model: nn.Sequential, sync: PeriodicSync, agreed: list[torch.Tensor], rank: int
) -> None:
    """Between syncs the replica trains on its own while validation and checkpoints see the
    weights the replicas last agreed on; a run that stops there ends on those."""
    with torch.no_grad():
        for tensor in [*model.parameters(), _running_mean(model)]:
            tensor.add_(float(rank + 10))
    sync.after_update()  # one of two: its own weights now differ
    own = [t.detach().clone() for t in [*model.parameters(), _running_mean(model)]]
    state = sync.agreed_state_dict(model.state_dict())
    names = ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean"]
    for name, want in zip(names, agreed, strict=True):
        torch.testing.assert_close(state[name], want, rtol=0, atol=1e-6)
    assert torch.equal(state["1.num_batches_tracked"], model.state_dict()["1.num_batches_tracked"])
    with sync.agreed_weights():
        for got, want in zip([*model.parameters(), _running_mean(model)], agreed, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for got, want in zip([*model.parameters(), _running_mean(model)], own, strict=True):
        assert torch.equal(got, want)  # its own again, bit for bit
    sync.settle()
    for got, want in zip([*model.parameters(), _running_mean(model)], agreed, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert sync.since_sync == 0 and sync.communication.syncs == 1  # settling sends nothing


def _worker(rank: int, world: int, init_file: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        local = _replica(rank)
        averaging = PeriodicSync(local, every=2)
        averaging.after_update()
        assert averaging.communication.syncs == 0  # one update of two: no sync yet
        averaging.after_update()
        replicas = [list(_replica(r).parameters()) for r in range(world)]
        mean = [sum(ps) / world for ps in zip(*replicas, strict=True)]
        for got, want in zip(local.parameters(), mean, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        running = torch.stack([_running_mean(_replica(r)) for r in range(world)]).mean(0)
        torch.testing.assert_close(_running_mean(local), running, rtol=0, atol=1e-6)
        _check_agreed_weights(local, averaging, [*mean, running], rank)

        diloco = _replica(0)  # every replica starts from the same anchors, then moves apart
        outer = PeriodicSync(diloco, every=1, outer=OuterSettings(lr=0.7, momentum=0.9))
        start = [p.detach().clone() for p in diloco.parameters()]
        momenta: list = [None] * len(start)
        for interval in range(2):
            with torch.no_grad():
                for p in diloco.parameters():
                    p.add_(float(rank + 1 + interval))
            moved = [p.detach().clone() for p in diloco.parameters()]
            gathered = [[torch.empty_like(t) for _ in range(world)] for t in moved]
            for out, tensor in zip(gathered, moved, strict=True):
                dist.all_gather(out, tensor)
            means = [torch.stack(parts).mean(0) for parts in gathered]
            start = _outer_by_hand(start, means, 0.7, 0.9, momenta)
            outer.after_update()
            for got, want in zip(diloco.parameters(), start, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

        n_bytes = sum(p.numel() * 4 for p in local.parameters()) + 2 * 2 * 4  # + mean, var
        torch.save(
            {
                "rank": rank,
                "averaging": averaging.communication.as_dict(),
                "diloco": outer.communication.as_dict(),
                "bytes_per_sync": n_bytes,
            },
            f"{results}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_local_sgd_averages_and_diloco_takes_the_outer_nesterov_step(tmp_path):
    world = 3  # not a power of two: the mean is divided, never a shifted sum
    mp.start_processes(
        _worker,
        args=(world, str(tmp_path / "init"), str(tmp_path)),
        nprocs=world,
        start_method="spawn",
    )
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["averaging"]["syncs"] == 1
        assert result["averaging"]["bytes_sent"] == result["bytes_per_sync"]
        assert result["diloco"]["syncs"] == 2
        assert result["averaging"]["wait_s"] > 0


def test_one_process_without_a_group_is_one_replica():
    """An in-process run: local SGD leaves its weights alone; DiLoCo still steps (outer
    Nesterov on its own change), sending nothing."""
    model = _replica(0)
    before = [p.detach().clone() for p in model.parameters()]
    PeriodicSync(model, every=1).after_update()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    diloco = PeriodicSync(model, every=1, outer=OuterSettings(lr=1.0, momentum=0.0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    diloco.after_update()  # lr 1, no momentum: the anchors move to the mean, its own weights
    assert all(torch.allclose(a + 1, b) for a, b in zip(before, model.parameters(), strict=True))
    assert diloco.communication.bytes_sent == 0 and diloco.communication.syncs == 1


def test_diloco_restarts_its_interval_from_weights_loaded_from_elsewhere():
    """A warm start (or a checkpoint without DiLoCo's state) loads other weights: the next
    outer step must start from them, not pull the model back to its first weights."""
    model = _replica(0)
    diloco = PeriodicSync(model, every=1, outer=OuterSettings(lr=0.7, momentum=0.5))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(5.0)  # weights loaded from a checkpoint
    diloco.restart()
    assert all(torch.equal(a, p) for a, p in zip(diloco.anchors, model.parameters(), strict=True))
    diloco.load_state_dict({"since_sync": 0})  # a local_sgd checkpoint's: no anchors
    assert all(torch.equal(a, p) for a, p in zip(diloco.anchors, model.parameters(), strict=True))
    loaded = [p.detach().clone() for p in model.parameters()]
    diloco.after_update()  # no change in the interval: the outer step keeps the weights
    assert all(torch.allclose(a, b) for a, b in zip(model.parameters(), loaded, strict=True))


def test_a_tied_weight_is_the_agreed_one_under_both_of_its_names():
    """A language model's embedding and output layer share one weight: the checkpoint's
    model holds the agreed weight under each name, not the replica's own under the second."""
    embedding = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = embedding.weight
    model = nn.Sequential(embedding, head)
    sync = PeriodicSync(model, every=2)
    agreed = embedding.weight.detach().clone()
    with torch.no_grad():
        embedding.weight.add_(1.0)
    sync.after_update()
    state = sync.agreed_state_dict(model.state_dict())
    assert torch.equal(state["0.weight"], agreed) and torch.equal(state["1.weight"], agreed)


def test_whether_the_epoch_under_way_synced_is_known_and_checkpointed():
    """The loop syncs at the end of an epoch that had no sync of its own (sync_every longer
    than an epoch): the sync says whether one happened, and a resume mid-epoch keeps it."""
    model = _replica(0)
    sync = PeriodicSync(model, every=100)
    sync.after_update()
    assert not sync.synced_in_epoch and not sync.state_dict()["synced_in_epoch"]
    sync.sync()
    assert sync.synced_in_epoch and sync.state_dict()["synced_in_epoch"]
    resumed = PeriodicSync(model, every=100)
    resumed.load_state_dict({"since_sync": 5, "synced_in_epoch": False})
    assert not resumed.synced_in_epoch and resumed.since_sync == 5
    resumed.load_state_dict({"since_sync": 0})  # written before the flag: synced every epoch
    assert resumed.synced_in_epoch
