"""Bandwidth and latency of MegaDPP's shared-memory transport against gloo send/recv, two processes
(``--device cuda``: the CUDA IPC transport between two GPUs against NCCL send/recv, the transport DPP
would otherwise use).

    python -m torch.distributed.run --nproc_per_node 2 bench/transport_bandwidth.py [--max-bytes 256M]
    python -m torch.distributed.run --nproc_per_node 2 bench/transport_bandwidth.py --device cuda --max-bytes 1G

Latency: half the median round trip of one message (ping-pong). Bandwidth: a stream of messages one
way, timed on the receiver from a common start to the last message. Prints a Markdown table (rank 0).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megadpp.transport import cuda_ipc_transport, shared_memory_transport
from megadpp.transport.factories import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS, DEFAULT_WORKLOAD


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


class Gloo:
    """Plain gloo point to point (CPU tensors), receiving into a buffer of known shape."""

    name = "gloo"

    def isend(self, tensor, peer):
        return dist.isend(tensor, peer)

    def irecv(self, like, peer):
        return dist.irecv(torch.empty_like(like), peer)

    @staticmethod
    def done(work):
        work.wait()


class Nccl:
    """NCCL send/recv into a buffer of known shape; done once the GPU has run it (as a CUDA IPC handle)."""

    name = "NCCL"

    def __init__(self):
        self.group = dist.new_group(backend="nccl")

    def isend(self, tensor, peer):
        return dist.isend(tensor, peer, group=self.group), None

    def irecv(self, like, peer):
        buffer = torch.empty_like(like)
        return dist.irecv(buffer, peer, group=self.group), buffer

    @staticmethod
    def done(pending):
        pending[0].wait()
        torch.cuda.current_stream().synchronize()


class Transport:
    def __init__(self, transport, name, on_gpu):
        self.transport = transport
        self.name = name
        self.on_gpu = on_gpu

    def isend(self, tensor, peer):
        return self.transport.isend(tensor, peer)

    def irecv(self, like, peer):
        return self.transport.irecv(peer)

    def done(self, handle):
        handle.wait()  # on GPUs: the copy is queued and the current stream ordered after it (as NCCL's wait)
        if self.on_gpu:
            torch.cuda.current_stream().synchronize()


def latency(link, rank, x, iters):
    peer = 1 - rank
    rounds = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            link.done(link.isend(x, peer))
            link.done(link.irecv(x, peer))
        else:
            link.done(link.irecv(x, peer))
            link.done(link.isend(x, peer))
        rounds.append(time.perf_counter() - start)
    return statistics.median(rounds) / 2


def bandwidth(link, rank, x, count, repeat):
    """Bytes per second of the best of ``repeat`` streams of ``count`` messages from rank 0 to rank 1,
    timed from the sender's first send to the receiver's last receive (one clock: CLOCK_MONOTONIC)."""
    best = float("inf")
    for _ in range(repeat):
        dist.barrier()
        stamp = torch.tensor([time.perf_counter_ns()], dtype=torch.int64)
        if rank == 0:
            for handle in [link.isend(x, 1) for _ in range(count)]:
                link.done(handle)
        else:
            for handle in [link.irecv(x, 0) for _ in range(count)]:
                link.done(handle)
            stamp[0] = time.perf_counter_ns()
        stamps = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(stamps, stamp)
        best = min(best, (stamps[1].item() - stamps[0].item()) / 1e9)
    return count * x.nbytes / best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=parse_bytes, default=4 << 10)
    parser.add_argument("--max-bytes", type=parse_bytes, default=256 << 20)
    parser.add_argument("--stream-bytes", type=parse_bytes, default=512 << 20,
                        help="bytes per bandwidth stream (at least 4 messages)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workload", type=parse_bytes, default=DEFAULT_WORKLOAD)
    parser.add_argument("--slot-bytes", type=parse_bytes, default=None,
                        help=f"bytes per shared-memory ring slot (default {DEFAULT_SLOT_BYTES >> 20} MiB; not with "
                             "--device cuda: CUDA IPC copies straight from the sender's tensor)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the CUDA IPC transport (the two ranks may share one GPU) against gloo via host")
    args = parser.parse_args()
    if args.device == "cuda" and args.slot_bytes is not None:
        parser.error("--slot-bytes sizes the shared-memory ring; the CUDA IPC transport has no ring of bytes")
    args.slot_bytes = args.slot_bytes or DEFAULT_SLOT_BYTES
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        transport = Transport(cuda_ipc_transport(rank, [1 - rank], device=device.index, name="bench"), "CUDA IPC",
                              on_gpu=True)
        links = [transport, Nccl()]
    else:
        device = torch.device("cpu")
        transport = Transport(shared_memory_transport(rank, [1 - rank], name="bench", workload=args.workload,
                                                      slot_bytes=args.slot_bytes), "shm", on_gpu=False)
        links = [transport, Gloo()]
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        x = torch.rand(size // 4, device=device)
        iters = max(5, min(200, (64 << 20) // size))
        count = max(4, args.stream_bytes // size)
        row = [size]
        row += [latency(link, rank, x, iters) for link in links]
        row += [bandwidth(link, rank, x, count, args.repeat) for link in links]
        rows.append(row)
        if rank == 0:
            print(f"{size} bytes done", flush=True)
        size *= 4
    transport.transport.close()
    if rank == 0:
        ours, theirs = (link.name for link in links)
        ring = (f"slots {DEFAULT_SLOTS}" if args.device == "cuda" else
                f"slots {DEFAULT_SLOTS} x {args.slot_bytes >> 20} MiB, workload {args.workload} bytes")
        print(f"\n{device}: {ring}; ratios: {ours} / {theirs}\n")
        print(f"| message | {ours} latency (µs) | {theirs} latency (µs) | latency ratio | {ours} bandwidth (GB/s) | "
              f"{theirs} bandwidth (GB/s) | bandwidth ratio |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for size, our_lat, their_lat, our_bw, their_bw in rows:
            label = (f"{size >> 30} GiB" if size >= 1 << 30 else f"{size >> 20} MiB" if size >= 1 << 20
                     else f"{size >> 10} KiB")
            print(f"| {label} | {our_lat * 1e6:.1f} | {their_lat * 1e6:.1f} | {our_lat / their_lat:.2f} | "
                  f"{our_bw / 1e9:.2f} | {their_bw / 1e9:.2f} | {our_bw / their_bw:.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
