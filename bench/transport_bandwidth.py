"""Bandwidth and latency of MegaDPP's shared-memory transport against gloo send/recv, two processes.

    python -m torch.distributed.run --nproc_per_node 2 bench/transport_bandwidth.py [--max-bytes 256M]

Latency: half the median round trip of one message (ping-pong). Bandwidth: a stream of messages one
way, timed on the receiver from a common start to the last message. Prints a Markdown table (rank 0).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megadpp.transport import shared_memory_transport
from megadpp.transport.factories import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS, DEFAULT_WORKLOAD


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


class Gloo:
    """Plain torch.distributed point to point, receiving into a buffer of known shape."""

    name = "gloo send/recv"

    def isend(self, tensor, peer):
        return dist.isend(tensor, peer)

    def irecv(self, like, peer):
        buffer = torch.empty_like(like)
        work = dist.irecv(buffer, peer)
        return work

    @staticmethod
    def done(work):
        work.wait()


class Transport:
    name = "megadpp shared memory"

    def __init__(self, transport):
        self.transport = transport

    def isend(self, tensor, peer):
        return self.transport.isend(tensor, peer)

    def irecv(self, like, peer):
        return self.transport.irecv(peer)

    @staticmethod
    def done(handle):
        handle.wait()


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
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    transport = shared_memory_transport(rank, [1 - rank], name="bench", workload=args.workload)
    links = [Transport(transport), Gloo()]
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        x = torch.ones(size // 4)
        iters = max(5, min(200, (64 << 20) // size))
        count = max(4, args.stream_bytes // size)
        row = [size]
        row += [latency(link, rank, x, iters) for link in links]
        row += [bandwidth(link, rank, x, count, args.repeat) for link in links]
        rows.append(row)
        if rank == 0:
            print(f"{size} bytes done", flush=True)
        size *= 4
    transport.close()
    if rank == 0:
        print(f"\nslots {DEFAULT_SLOTS} x {DEFAULT_SLOT_BYTES >> 20} MiB, workload {args.workload} bytes\n")
        print("| message | shm latency (µs) | gloo latency (µs) | shm bandwidth (GB/s) | gloo bandwidth (GB/s) |")
        print("|---:|---:|---:|---:|---:|")
        for size, shm_lat, gloo_lat, shm_bw, gloo_bw in rows:
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            print(f"| {label} | {shm_lat * 1e6:.1f} | {gloo_lat * 1e6:.1f} | {shm_bw / 1e9:.2f} | {gloo_bw / 1e9:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
