"""One MolmoE-1B MoE block's experts at the released size: the runtime's grouping against the
origin's per-expert loop, in the same process.

    python benchmarks/bench_moe_experts.py                          # CPU, float32
    python benchmarks/bench_moe_experts.py --device cuda --dtype bfloat16

64 experts of width 1024 over a 2048-wide hidden state, each token routed to its top 8 (random
router logits, seeded). ``loop`` is the origin's arithmetic as the origin arranges it: per expert,
``torch.where`` over the one-hot routing mask, a host sync each. ``runtime`` is
``runtime.molmoe_model.MolmoEExperts``: the same matmuls on the same rows, grouped with one sort
and one host sync per block. Both are checked to give the same output bit for bit, then timed
(median of ``--reps`` after ``--warmup``) at 1 token (a decode step) and at ``--prefill``
tokens. A decoder forward runs 16 such blocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.molmoe_model import MolmoEExperts

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 64, 2048, 1024, 8


def per_expert_loop(experts: MolmoEExperts, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    inter = experts.intermediate
    mask = F.one_hot(top_k_index, num_classes=experts.num_experts).permute(2, 1, 0)
    for expert in mask.sum(dim=(1, 2)).nonzero().flatten().tolist():
        slot, token = torch.where(mask[expert])
        x, w = hidden[token], experts.gate_up_proj[expert]
        h = F.silu(F.linear(x, w[:inter])) * F.linear(x, w[inter:])
        h = F.linear(h, experts.down_proj[expert]) * weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


def timed(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn()``, the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prefill", type=int, default=600, help="tokens of the prefill case")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    experts = MolmoEExperts(EXPERTS, HIDDEN, INTERMEDIATE)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) * 0.02)
        experts.down_proj.copy_(torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) * 0.02)
    experts = experts.to(device=device, dtype=dtype).eval()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"# one MoE block's experts ({EXPERTS} x {INTERMEDIATE} over {HIDDEN}, top {TOP_K}), {args.dtype}, {name}")
    print("| tokens | origin loop ms | runtime ms | loop / runtime | same output |")
    print("|---:|---:|---:|---:|---|")
    for tokens in (1, args.prefill):
        logits = torch.randn(tokens, EXPERTS, generator=g)
        weights, index = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
        hidden = torch.randn(tokens, HIDDEN, generator=g).to(device=device, dtype=dtype)
        index, weights = index.to(device), weights.to(device=device, dtype=dtype)
        with torch.inference_mode():
            same = torch.equal(experts(hidden, index, weights), per_expert_loop(experts, hidden, index, weights))
            loop = timed(lambda: per_expert_loop(experts, hidden, index, weights), device, args.warmup, args.reps)
            grouped = timed(lambda: experts(hidden, index, weights), device, args.warmup, args.reps)
        print(f"| {tokens} | {loop:.2f} | {grouped:.2f} | {loop / grouped:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
