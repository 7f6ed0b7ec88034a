"""Under gradsyncrun --standalone -n 2 (the CTest torch_ddp_gradsync): backend "gradsync" against
gloo in the same processes. Each collective (allreduce with every op, broadcast, all_gather,
_allgather_base, reduce_scatter, _reduce_scatter_base, barrier; async Works and their futures)
is compared with gloo (gloo in torch 1.13 has no reduce_scatter: its reference is a gloo
allreduce and this rank's block), then a DDP training of a small MLP with backend gradsync must
end with the same parameters as the same training with DDP over gloo. Exit status 0 on success.
"""
import os
import sys

import torch
import torch.distributed as dist

import gradsync_torch

TOLERANCE = 1e-6  # two ranks: a + b is the same sum on both backends; any difference is a bug


def fail(msg):
    print(f"FAIL rank {os.environ.get('RANK')}: {msg}", flush=True)
    sys.exit(1)


def expect_equal(name, got, want, tol=0.0):
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if got.shape != want.shape or diff > tol:
        fail(f"{name}: gradsync {got.flatten()[:6].tolist()} vs gloo {want.flatten()[:6].tolist()} (max diff {diff})")


def sample(rank, n, dtype, salt):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 4).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def check_collectives(gloo, rank, world):
    ops = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX}
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        for name, op in ops.items():
            a = sample(rank, 1000, dtype, 1)
            b = a.clone()
            dist.all_reduce(a, op=op)
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            gloo.allreduce([b], opts).wait()
            expect_equal(f"all_reduce {name} {dtype}", a, b)
    # avg: gloo has none; its reference is gloo's sum over the world size.
    a = sample(rank, 777, torch.float32, 2)
    b = a.clone()
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    gloo.allreduce([b]).wait()
    expect_equal("all_reduce avg", a, b / world, 1e-6)

    for root in range(world):
        a = sample(rank, 300, torch.float32, 3)
        b = a.clone()
        dist.broadcast(a, src=root)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        gloo.broadcast([b], opts).wait()
        expect_equal(f"broadcast root {root}", a, b)

    x = sample(rank, 123, torch.float64, 4)
    got = [torch.empty_like(x) for _ in range(world)]
    want = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(got, x)
    gloo.allgather([want], [x]).wait()
    for r in range(world):
        expect_equal(f"all_gather block {r}", got[r], want[r])
    flat = torch.empty(world * x.numel(), dtype=x.dtype)
    dist.distributed_c10d._get_default_group()._allgather_base(flat, x).wait()
    expect_equal("_allgather_base", flat, torch.cat(want))

    blocks = [sample(rank, 50, torch.float32, 10 + r) for r in range(world)]
    full = torch.cat(blocks)
    gloo.allreduce([full]).wait()
    want = full.narrow(0, rank * 50, 50)
    out = torch.empty(50)
    dist.reduce_scatter(out, blocks)
    expect_equal("reduce_scatter", out, want)
    out2 = torch.empty(50)
    dist.distributed_c10d._get_default_group()._reduce_scatter_base(out2, torch.cat(blocks)).wait()
    expect_equal("_reduce_scatter_base", out2, want)

    # Async: several calls in flight, completed through their futures, in any wait order.
    tensors = [sample(rank, 4000, torch.float32, 20 + i) for i in range(5)]
    refs = [t.clone() for t in tensors]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future() for w in works]
    for i in reversed(range(5)):
        value = futures[i].wait()
        gloo.allreduce([refs[i]]).wait()
        expect_equal(f"async all_reduce {i} (future)", value[0], refs[i])
        if not works[i].is_completed():
            fail("a Work is not completed after its future")
    dist.barrier()
    print(f"rank {rank}: every collective matches gloo", flush=True)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                       torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x)


def train(process_group, rank, steps=8):
    torch.manual_seed(0)
    model = MLP()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main():
    gradsync_torch.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}: torch {torch.__version__}, {dist.distributed_c10d._get_default_group().describe()}", flush=True)
    store = dist.FileStore(f"/tmp/gradsync-gloo-{os.environ['GRADSYNC_JOB_ID']}", world)
    gloo = dist.ProcessGroupGloo(store, rank, world)
    check_collectives(gloo, rank, world)

    with_gradsync = train(None, rank)  # the default group: gradsync
    with_gloo = train(gloo, rank)
    worst = max((a - b).abs().max().item() for a, b in zip(with_gradsync, with_gloo))
    if worst > TOLERANCE:
        fail(f"DDP parameters differ between gradsync and gloo: max |diff| {worst}")
    print(f"OK: rank {rank}: DDP over gradsync ends with gloo's parameters (max |diff| {worst}, "
          f"tolerance {TOLERANCE})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
