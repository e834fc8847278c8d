"""One rank of a transport test (launched by tests/test_megadpp_transport.py through torchrun, gloo).

    exchange  every rank sends every test tensor to every other rank over the shared-memory, the
              torch.distributed and the routed (--multi-node) transports; checks values, order,
              observer events, and equality with plain gloo send/recv of the same tensors
    cuda-ipc  the same exchange of GPU tensors over CUDA IPC (two processes may share one GPU)
    cuda-ipc-race  CUDA IPC with the streams busy: rank 0 sends tensors still being computed and overwrites each
              once its send completes, rank 1 checks what it takes only after slow work queued before the check:
              any copy that overtakes the work it must follow shows as a wrong value
    sigkill   rank 1 kills itself (SIGKILL) with sends outstanding; the test then checks /dev/shm
    too-small the transport is given less /dev/shm than it needs (a cap, not a full /dev/shm)
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

from megadpp.transport import (
    TransportSetupError,
    create_transport,
    cuda_ipc_transport,
    distributed_transport,
    shared_memory_transport,
)
from megadpp.transport.distributed import DistributedTransport
from megadpp.transport.node import NodeTransport
from megatron.training.errors import exit_on_user_error

SMALL_RING = {"slots": 4, "slot_bytes": 64 << 10}  # large messages span slots and wrap the ring
GLOO_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
               torch.int32, torch.int64)


def test_tensors(sender):
    """The same list on every rank for a given sender: dtypes, shapes, empty and non-contiguous tensors."""
    g = torch.Generator().manual_seed(sender)
    tensors = [(torch.randn(4, 7, 2, generator=g) * 50).to(dtype) for dtype in GLOO_DTYPES]
    base = torch.randn(6, 8, generator=g)
    tensors += [
        torch.randn(2, 3, generator=g) > 0,
        torch.randn(3, 2, generator=g, dtype=torch.complex64),
        torch.tensor(3.5 + sender),                        # 0-d
        torch.empty(0, 5), torch.empty(0, dtype=torch.int64),
        base.t(), base[::2, 1::3],                         # non-contiguous
        torch.randn(1, 2, 1, 3, 1, 2, 1, 2, generator=g),  # many dims
        torch.randn(300_000, generator=g),                 # 1.2 MB: 19 slots of 64 KiB
    ]
    return tensors


def identical(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def exchange(transport, rank, peers, device="cpu"):
    """All receives posted first (in reverse tag order), then all sends: many outstanding each way."""
    received = {p: [None] * len(test_tensors(p)) for p in peers}
    recvs = [(p, i, transport.irecv(p, tag=i)) for p in peers for i in reversed(range(len(received[p])))]
    sends = [transport.isend(t.to(device), p, tag=i) for p in peers for i, t in enumerate(test_tensors(rank))]
    # One tag, many messages: they must arrive in the order sent, interleaved with the tagged ones.
    ordered = {p: [transport.irecv(p, tag=1000) for _ in range(40)] for p in peers}
    order_sends = [transport.isend(torch.tensor([k, rank], device=device), p, tag=1000)
                   for p in peers for k in range(40)]
    for p, i, handle in recvs:
        received[p][i] = handle.wait(timeout=120).cpu()
    for handle in sends + order_sends:
        handle.wait(timeout=120)
    for p in peers:
        for i, (got, want) in enumerate(zip(received[p], test_tensors(p))):
            assert identical(got, want.contiguous()), f"rank {rank}: message {i} from {p}: {got} != {want}"
            assert got.is_contiguous()
        order = [h.wait(timeout=120).cpu().tolist() for h in ordered[p]]
        assert order == [[k, p] for k in range(40)], f"rank {rank}: out of order from {p}: {order}"
    return received


def gloo_exchange(rank, peers):
    """The same tensors through plain gloo send/recv (shapes known in advance), for comparison."""
    ops, got = [], {}
    for p in peers:
        for t in test_tensors(rank):
            if t.dtype in GLOO_DTYPES and t.numel():
                ops.append(dist.P2POp(dist.isend, t.contiguous(), p))
        for i, t in enumerate(test_tensors(p)):
            if t.dtype in GLOO_DTYPES and t.numel():
                got[p, i] = torch.empty_like(t, memory_format=torch.contiguous_format)
                ops.append(dist.P2POp(dist.irecv, got[p, i], p))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got


def check_events(events, rank, peers):
    per_message = len(test_tensors(0)) + 40
    assert len(events) == 2 * per_message * len(peers), len(events)
    for op in ("send", "recv"):
        for p in peers:
            mine = [e for e in events if e.op == op and e.peer == p]
            assert sorted(e.seq for e in mine) == list(range(per_message)), (op, p)
            assert all(e.end_ns >= e.start_ns for e in mine)
    big = [e for e in events if e.op == "send" and e.tag == len(test_tensors(0)) - 1]
    assert {e.nbytes for e in big} == {300_000 * 4}


def routed(rank, peers, observer):
    """--multi-node with two "nodes" of two ranks (--node-ips): shared memory to the rank of this
    node, torch.distributed to the other two."""
    flags = argparse.Namespace(device="cpu", multi_node=True, node_ips="127.0.0.1,127.0.0.2", workload=None)
    try:  # GPU neighbours on other nodes would need NCCL: refused in one line, before anything is made
        create_transport(argparse.Namespace(**{**vars(flags), "device": "cuda"}), peers)
        raise AssertionError("GPU pipeline neighbours on other nodes were not refused")
    except TransportSetupError as error:
        assert "are pipeline neighbours on other nodes" in str(error), error
    transport = create_transport(flags, peers, observer=observer)
    kinds = {peer: type(transport.routes[peer]) for peer in peers}
    assert kinds == {p: NodeTransport if p // 2 == rank // 2 else DistributedTransport for p in peers}, kinds
    return transport


def run_exchange(rank, world):
    peers = [p for p in range(world) if p != rank]
    gloo = gloo_exchange(rank, peers)
    factories = {
        "shared memory": lambda observer: shared_memory_transport(rank, peers, name="exchange", observer=observer,
                                                                  workload=16 << 10, **SMALL_RING),
        "torch.distributed": lambda observer: distributed_transport(rank, peers, observer=observer),
        "routed (--multi-node)": lambda observer: routed(rank, peers, observer),
    }
    for kind, make in factories.items():
        events = []
        with make(events.append) as transport:
            received = exchange(transport, rank, peers)
        check_events(events, rank, peers)
        for (p, i), want in gloo.items():
            assert identical(received[p][i], want), f"{kind}: message {i} from {p} differs from gloo's"
        print(f"rank {rank}: {kind} exchange matches gloo", flush=True)


def run_cuda_ipc(rank, world):
    """Processes that may share one GPU: GPU tensors over CUDA IPC, same checks as over shared memory."""
    peers = [p for p in range(world) if p != rank]
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    events = []
    with cuda_ipc_transport(rank, peers, device=device, name="cuda", observer=events.append, slots=4) as transport:
        exchange(transport, rank, peers, device=f"cuda:{device}")
    check_events(events, rank, peers)
    print(f"rank {rank}: CUDA IPC exchange on cuda:{device} matches", flush=True)


def run_cuda_ipc_race(rank, rounds=200):
    """Every message holds its round's number. Neither host waits for its GPU until the end, and both keep their
    compute streams busy, so that a copy ordered wrongly against the compute stream (in either process) changes a
    value instead of passing unseen."""
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    busy = torch.randn(4096, 4096, device=f"cuda:{device}")  # a product takes a fraction of a millisecond
    checks = []
    with cuda_ipc_transport(rank, [1 - rank], device=device, name="race", slots=4) as transport:
        for k in range(rounds):
            if rank == 0:
                message = busy @ busy  # still running when isend returns: the receiver's copy must wait for it
                message.mul_(0).add_(k)
                transport.isend(message, 1, tag=k % 3).wait(timeout=120)
                message.fill_(-1.0)  # after the send completes: must not reach the receiver's copy
            else:
                got = transport.irecv(0, tag=k % 3).wait(timeout=120)
                busy @ busy  # the check below runs after this; meanwhile `got` must not be received into again
                checks.append((got == k).all())
        torch.cuda.synchronize()
    wrong = [k for k, right in enumerate(checks) if not right.item()]
    assert not wrong, f"rank {rank}: rounds {wrong[:10]} received wrong values ({len(wrong)} of {rounds})"
    print(f"rank {rank}: CUDA IPC under busy streams: {rounds} rounds right", flush=True)


def run_sigkill(rank, out_dir):
    with open(os.path.join(out_dir, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    transport = shared_memory_transport(rank, [1 - rank], name="sigkill", **SMALL_RING)
    if rank == 1:
        # 8 MB into a 256 KiB ring; the handles are kept referenced until the SIGKILL so the sends stay outstanding
        _outstanding = [transport.isend(torch.ones(1 << 18), 0, tag=k) for k in range(8)]
        transport.irecv(0, tag=5).wait(timeout=120)  # rank 0 has its channels: both rings are in use
        print("rank 1: killing myself with sends outstanding", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    transport.isend(torch.zeros(3), 1, tag=5).wait(timeout=120)
    transport.irecv(1, tag=99).wait(timeout=300)  # never comes: the launcher ends this rank


def run_too_small(rank, world):
    peers = [p for p in range(world) if p != rank]
    shared_memory_transport(rank, peers, name="small", shm_limit_bytes=1 << 20, slots=8, slot_bytes=1 << 20)
    raise AssertionError("the transport started with less /dev/shm than it needs")


@exit_on_user_error
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["exchange", "cuda-ipc", "cuda-ipc-race", "sigkill", "too-small"])
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.scenario == "exchange":
        run_exchange(rank, world)
    elif args.scenario == "cuda-ipc":
        run_cuda_ipc(rank, world)
    elif args.scenario == "cuda-ipc-race":
        run_cuda_ipc_race(rank)
    elif args.scenario == "sigkill":
        run_sigkill(rank, args.out_dir)
    else:
        run_too_small(rank, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
