"""Per-step cost of handing a step's inputs (HostBatch) from rank 0 to tensor-parallel workers, on CPU.

    python benchmarks/tp_step_broadcast.py [--steps 500] [--workers 1] [--gap-us 2000]

Rank 0 and ``--workers`` spawned workers join a gloo group. Each step mimics the engine: rank 0 does
``--gap-us`` of host work (sampling, scheduling: the workers wait meanwhile, long enough to go to sleep), hands
out a HostBatch, and all ranks meet in one small all-reduce (the forward's collectives keep them in step).
Two transports, alternated in blocks so that both see the same machine load: gloo ``broadcast_object_list``
(the previous transport) and the shared-memory ring (``nanovllm_core.engine.shm_ring``), pickled HostBatch.

Reported per transport and payload (medians over all steps):
- send: how long rank 0's call takes (what rank 0 pays each step);
- delivery: from rank 0 starting the send to the worker holding the unpickled HostBatch (how long the
  worker's forward is held up), measured on the shared monotonic clock.
Payloads: a decode step of 256 sequences (context 1024, block size 256) and a prefill chunk of 8192 tokens.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm_core.engine.model_runner import HostBatch
from nanovllm_core.engine.parallel import free_port, spin_seconds
from nanovllm_core.engine.shm_ring import BroadcastRing, RingLayout

TRANSPORTS = ("gloo", "ring")


def decode_batch(num_seqs: int = 256, context: int = 1024, block_size: int = 256) -> HostBatch:
    blocks = -(-context // block_size)
    return HostBatch(
        input_ids=[1000 + i for i in range(num_seqs)],
        positions=[context - 1] * num_seqs,
        slot_mapping=[i * blocks * block_size + context - 1 for i in range(num_seqs)],
        query_start_loc=list(range(num_seqs + 1)),
        seq_lens=[context] * num_seqs,
        max_blocks=blocks,
        max_query_len=1,
        logits_indices=list(range(num_seqs)),
        sample_rows=list(range(num_seqs)),
        block_tables=list(range(num_seqs * blocks)),
    )


def prefill_batch(num_tokens: int = 8192, num_seqs: int = 8, block_size: int = 256) -> HostBatch:
    per_seq = num_tokens // num_seqs
    blocks = -(-per_seq // block_size)
    return HostBatch(
        input_ids=[(7 * i) % 150_000 for i in range(num_tokens)],
        positions=[i % per_seq for i in range(num_tokens)],
        slot_mapping=list(range(num_tokens)),
        query_start_loc=[i * per_seq for i in range(num_seqs + 1)],
        seq_lens=[per_seq] * num_seqs,
        max_blocks=blocks,
        max_query_len=per_seq,
        logits_indices=[(i + 1) * per_seq - 1 for i in range(num_seqs)],
        sample_rows=list(range(num_seqs)),
        block_tables=list(range(num_seqs * blocks)),
    )


PAYLOADS = {"decode-256": decode_batch(), "prefill-8192": prefill_batch()}


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(rank: int, world: int, port: int, ring: BroadcastRing, steps: int, blocks: int, gap_s: float) -> dict:
    """Every rank runs this; returns {(payload, transport): (send times, delivery times)} on rank 0."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ring.spin_s = spin_seconds("cpu")
    sync = torch.zeros(1)
    results: dict = {}
    per_block = steps // blocks
    for name, batch in PAYLOADS.items():
        for _ in range(blocks):
            for transport in TRANSPORTS:
                sends, stamps = [], torch.zeros(per_block, dtype=torch.float64)
                for i in range(per_block):
                    if rank == 0:
                        busy(gap_s)
                        start = time.perf_counter()
                        if transport == "gloo":
                            dist.broadcast_object_list([("step", batch)], src=0)
                        else:
                            ring.send(pickle.dumps(("step", batch), protocol=pickle.HIGHEST_PROTOCOL))
                        sends.append(time.perf_counter() - start)
                        stamps[i] = start
                    else:
                        if transport == "gloo":
                            message = [None]
                            dist.broadcast_object_list(message, src=0)
                        else:
                            message = pickle.loads(ring.recv())
                        stamps[i] = time.perf_counter()
                    dist.all_reduce(sync)
                # delivery = the slowest worker's arrival time minus rank 0's start
                arrived = stamps.clone() if rank else torch.full_like(stamps, -1e30)
                dist.all_reduce(arrived, op=dist.ReduceOp.MAX)
                if rank == 0:
                    entry = results.setdefault((name, transport), ([], []))
                    entry[0].extend(sends)
                    entry[1].extend((arrived - stamps).tolist())
    dist.destroy_process_group()
    return results


def worker(rank: int, world: int, port: int, layout: RingLayout, doorbell, args: argparse.Namespace) -> None:
    ring = BroadcastRing.attach(layout, rank - 1, doorbell)
    run(rank, world, port, ring, args.steps, args.blocks, args.gap_us * 1e-6)
    ring.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500, help="steps per transport and payload")
    parser.add_argument("--blocks", type=int, default=10, help="alternate the transports this many times")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--gap-us", type=float, default=2000.0, help="rank 0's host work between two steps")
    args = parser.parse_args()
    world = args.workers + 1
    for name, batch in PAYLOADS.items():
        size = len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
        start = time.perf_counter()
        for _ in range(100):
            pickle.loads(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
        elapsed_us = (time.perf_counter() - start) / 100 * 1e6
        print(f"{name}: {size / 1024:.1f} KiB pickled, pickle + unpickle {elapsed_us:.0f} us")
    writer = BroadcastRing.create(args.workers)
    bells = writer.make_doorbells()
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=worker, args=(r, world, port, writer.layout, bells[r - 1], args)) for r in range(1, world)
    ]
    for p in procs:
        p.start()
    results = run(0, world, port, writer, args.steps, args.blocks, args.gap_us * 1e-6)
    for p in procs:
        p.join()
    writer.close(unlink=True)
    load = os.getloadavg()[0]
    print(
        f"{os.cpu_count()} CPUs (load {load:.1f}), {world} ranks, {args.steps} steps per transport, "
        f"{args.gap_us:.0f} us of rank-0 work between steps; medians (p90):"
    )
    for name in PAYLOADS:
        for transport in TRANSPORTS:
            sends, deliveries = results[(name, transport)]
            q = lambda xs: f"{statistics.median(xs) * 1e6:6.0f} us ({statistics.quantiles(xs, n=10)[-1] * 1e6:.0f})"  # noqa: E731
            print(f"  {name:13s} {transport:5s} send {q(sends)}, delivery {q(deliveries)}")


if __name__ == "__main__":
    main()
