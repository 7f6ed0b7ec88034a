"""For scripts/torch-gpu-check.sh on a GPU machine: under gradsyncrun --standalone -n 2 with
GRADSYNC_DEVICE=0 (both ranks on GPU 0). Backend "gradsync" with CUDA tensors: allreduce,
broadcast, all_gather, reduce_scatter checked against the same data on the CPU, then one DDP
step of a small MLP on cuda:0 whose averaged gradients must equal the mean of every rank's
local gradients (gathered on the CPU through gloo on a FileStore). Prints CHECK lines.
"""
import os
import sys

import torch
import torch.distributed as dist

import gradsync_torch


def check(name, ok, detail=""):
    print(f"CHECK rank {dist.get_rank()} {name}: {'ok' if ok else 'FAILED ' + detail}", flush=True)
    if not ok:
        sys.exit(1)


def describe_backend():
    """The gradsync backend's own description: torch 1.13's default group is our ProcessGroup;
    torch 2.x wraps backends in a ProcessGroup and hands ours out per device."""
    pg = dist.distributed_c10d._get_default_group()
    if hasattr(pg, "describe"):
        return pg.describe()
    try:
        return pg._get_backend(torch.device("cuda")).describe()
    except (AttributeError, RuntimeError) as e:
        return f"backend {dist.get_backend()} ({type(e).__name__}: {e})"


def main():
    gradsync_torch.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    print(f"rank {rank}: torch {torch.__version__}, {describe_backend()}", flush=True)
    gloo = dist.ProcessGroupGloo(dist.FileStore(f"/tmp/gradsync-gloo-{os.environ['GRADSYNC_JOB_ID']}", world), rank, world)

    x = torch.arange(1000, dtype=torch.float32, device=dev) * (rank + 1)
    dist.all_reduce(x)
    want = torch.arange(1000, dtype=torch.float32) * sum(r + 1 for r in range(world))
    check("allreduce cuda", torch.equal(x.cpu(), want))
    b = torch.full((257,), float(rank), device=dev)
    dist.broadcast(b, src=1)
    check("broadcast cuda", torch.equal(b.cpu(), torch.full((257,), 1.0)))
    parts = [torch.empty(10, device=dev) for _ in range(world)]
    dist.all_gather(parts, torch.full((10,), float(rank), device=dev))
    check("all_gather cuda", all(torch.equal(p.cpu(), torch.full((10,), float(r))) for r, p in enumerate(parts)))
    out = torch.empty(10, device=dev)
    dist.reduce_scatter(out, [torch.full((10,), float(r + rank), device=dev) for r in range(world)])
    check("reduce_scatter cuda", torch.equal(out.cpu(), torch.full((10,), float(sum(rank + r for r in range(world))))))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(dev)
    local = [p.detach().clone() for p in model.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.001)
    g = torch.Generator().manual_seed(rank)
    xb = torch.randn(16, 32, generator=g).to(dev)
    yb = torch.randn(16, 1, generator=g).to(dev)
    torch.nn.functional.mse_loss(ddp(xb), yb).backward()
    torch.cuda.synchronize()
    # Reference: the same gradients computed locally on the CPU, averaged through gloo.
    ref = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    with torch.no_grad():
        for p, q in zip(ref.parameters(), local):
            p.copy_(q.cpu())
    torch.nn.functional.mse_loss(ref(xb.cpu()), yb.cpu()).backward()
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        avg = q.grad.clone()
        gloo.allreduce([avg]).wait()
        avg /= world
        worst = max(worst, (p.grad.cpu() - avg).abs().max().item())
    check("DDP step on cuda:0, gradients = mean of local CPU gradients (tolerance 1e-5)", worst <= 1e-5, f"max diff {worst}")
    print(f"OK: rank {rank}: DDP step with CUDA tensors over gradsync (max grad diff {worst:.3g})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
