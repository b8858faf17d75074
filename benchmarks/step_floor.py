"""The least bytes the MHAR arm moves a step beyond the control, and the best MHAR/control they allow at copy
bandwidth: what `make bench-step` prints beside each measured ratio (issue 53 asks where a target is out of
reach, by how much and why).

Counted, per microbatch of `tokens` rows of width `dim`:
- the routing, pass by pass as the launch tables split it (benchmarks.routing_bytes: the model's calls, a block's
  sites a call), and again as the least a block-level dataflow can move (each block's sources read once by the
  forward and once by the stats pass);
- the bodies' extra traffic: each routed term read by its norm in the forward, read again for the norm's
  backward (which needs u = x + routed: recomputed under full AC, otherwise saved, a write, or recomputed) and its
  gradient written, in every AC mode; each block delta written in the forward, its running sum read by the
  block's later layers, its gradient read in the backward (the last block's delta is never a source).
Left out, so that the floor stays a lower bound: per-token scalars in the bodies, the routing parameters and
their optimizer and EMA updates, launch latency. The AC mode changes the control's step, not these bytes.

    python -m benchmarks.step_floor --layers 8 --num-blocks 8 --control-tokens-per-s 29234 --copy-tbps 2.93
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

from benchmarks.routing_bytes import PASSES, pass_bytes
from kernels.triton.launch import DEFAULT_TABLES, MAX_SOURCES, LaunchTables
from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.sources import SITE_NAMES, SourceLayout

TARGET = 0.985  # issue 53's MHAR/control
REPO = Path(__file__).resolve().parents[1]


def block_calls(layers: int, num_blocks: int) -> list[tuple[int, int]]:
    """The model's routing calls in forward order, each (stored sources it reads, sites it routes): block b routes
    its 2P sites over the embedding and the b earlier blocks' deltas (MHARTransformer.route_block)."""
    try:
        layout = SourceLayout(num_blocks, layers)
    except ValueError:
        raise ValueError(f"{layers} layers do not split into {num_blocks} blocks of equal size") from None
    if not layout.fits(MAX_SOURCES):
        raise ValueError(
            f"{num_blocks} blocks read up to {layout.max_caller_sources} stored sources; the kernels take {MAX_SOURCES}"
        )
    return [(layout.caller_sources(block[0]), layout.sites_per_block) for block in layout.blocks()]


def least_tables(sites: int, tables: LaunchTables = DEFAULT_TABLES) -> LaunchTables:
    """`tables` with a block's `sites` forwarded in one pass and its stats in one launch: a block's sources read
    once a pass, the least the block-level dataflow moves."""
    return tables.replace(
        fwd_sites={n: {"sites": sites} for n in tables.fwd_sites},
        stats_pair={n: {"grouped": True} for n in tables.stats_pair},
    )


def body_bytes(layers: int, num_blocks: int, unit: int) -> int:
    """The bodies' extra bytes a microbatch (see the module's docstring); `unit` is one [tokens, dim] tensor."""
    layout = SourceLayout(num_blocks, layers)
    routed = len(SITE_NAMES) * layers * 3 * unit  # each site's: read for the norm, for its backward; gradient written
    per_block = layout.layers_per_block
    sourced = layout.deltas * per_block  # layers whose block delta becomes a source
    deltas = sourced * 2 * unit + layout.deltas * (per_block - 1) * unit  # written, gradient read; running sum
    return routed + deltas


@dataclasses.dataclass(frozen=True)
class Floor:
    """One geometry's floor against a measured control step."""

    routing: dict[str, int]  # bytes by pass, as launched
    least_routing: int  # bytes, a block's sources read once a pass
    bodies: int
    control_ms: float
    bandwidth: float  # bytes/s

    def ms(self, nbytes: int) -> float:
        return nbytes / self.bandwidth * 1e3

    @property
    def launched(self) -> int:
        return sum(self.routing.values()) + self.bodies

    @property
    def least(self) -> int:
        return self.least_routing + self.bodies

    def best_ratio(self, nbytes: int) -> float:
        return self.control_ms / (self.control_ms + self.ms(nbytes))

    @property
    def budget_ms(self) -> float:
        return self.control_ms * (1 / TARGET - 1)


def step_floor(
    layers: int,
    num_blocks: int,
    tokens: int,
    dim: int,
    heads: int,
    control_tokens_per_s: float,
    bandwidth: float,
    itemsize: int = 2,
    tables: LaunchTables = DEFAULT_TABLES,
) -> Floor:
    """The floor of one microbatch step of `tokens` tokens a device (bf16 sources: `itemsize` 2)."""
    calls = block_calls(layers, num_blocks)
    launched = pass_bytes(calls, tokens, dim, heads, itemsize, tables)
    least = pass_bytes(calls, tokens, dim, heads, itemsize, least_tables(calls[0][1], tables))
    return Floor(
        routing={kind: launched[kind][1] for kind in PASSES},
        least_routing=sum(least[kind][1] for kind in PASSES),
        bodies=body_bytes(layers, num_blocks, tokens * dim * itemsize),
        control_ms=tokens / control_tokens_per_s * 1e3,
        bandwidth=bandwidth,
    )


def describe(floor: Floor, measured: float | None = None) -> list[str]:
    """The floor in a few lines: bytes, their time at copy bandwidth, the ratio each allows, the target's budget."""
    passes = ", ".join(f"{kind} {nbytes / 1e9:.2f}" for kind, nbytes in floor.routing.items() if nbytes)
    lines = [
        f"MHAR's extra bytes a step: routing {sum(floor.routing.values()) / 1e9:.2f} GB as launched ({passes}), "
        f"{floor.least_routing / 1e9:.2f} GB at the least (a block's sources once a pass); bodies "
        f"{floor.bodies / 1e9:.2f} GB",
        f"at copy bandwidth {floor.bandwidth / 1e12:.2f} TB/s: {floor.ms(floor.launched):.2f} ms as launched, "
        f"{floor.ms(floor.least):.2f} ms at the least, against the control's step of {floor.control_ms:.1f} ms, "
        f"whose budget at MHAR/control {TARGET} is {floor.budget_ms:.2f} ms",
        f"best MHAR/control at copy bandwidth: {floor.best_ratio(floor.launched):.4f} as launched, "
        f"{floor.best_ratio(floor.least):.4f} at the least"
        + ("" if measured is None else f"; measured {measured:.4f}"),
    ]
    extra_ms = None if measured is None else floor.control_ms * (1 / measured - 1)
    if extra_ms is not None and extra_ms > 0:
        lines.append(
            f"the MHAR arm's measured extra time {extra_ms:.2f} ms moves the launched bytes at "
            f"{floor.ms(floor.launched) / extra_ms:.0%} of copy bandwidth"
        )
    elif extra_ms is not None:  # run-to-run noise, or a floor that counts too much: say so, share nothing
        lines.append("the MHAR arm measured no slower than the control: run-to-run noise, or a floor counting too much")
    return lines


def measured_bandwidth() -> float:
    """The GPU's copy bandwidth (bytes/s), measured in a process of its own: `make bench-step`'s own process makes
    no CUDA context, and this runs after its arms, on the GPU they used."""
    code = "from benchmarks.routing_cases import copy_bandwidth; print(copy_bandwidth())"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=300
    )
    return float(done.stdout.split()[-1])


def print_floors(results: dict[str, dict[str, dict[str, float]]], flavor: str, num_blocks: int, tokens: int) -> None:
    """Per AC mode (or mode/mask) that ran the control and the fused MHAR arm: the floor beside the measured
    MHAR/control, at the copy bandwidth measured now (bench_step, after its arms, at their `flavor`)."""
    cells = {key: arms for key, arms in results.items() if "control" in arms and "mhar_triton" in arms}
    if not cells:
        return
    try:
        bandwidth = measured_bandwidth()
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:  # the arms' figures stand
        print(f"\nfloor: not computed, the copy bandwidth could not be measured: {e}")
        return
    model, heads = FLAVORS[flavor], MHAR().num_heads
    for key, arms in cells.items():
        control = arms["control"]["tokens_per_s"]
        floor = step_floor(model.n_layers, num_blocks, tokens, model.dim, heads, control, bandwidth)
        print(f"\nfloor, {key} AC ({model.n_layers} layers, {num_blocks} blocks; benchmarks.step_floor):")
        print("\n".join(describe(floor, arms["mhar_triton"]["tokens_per_s"] / control)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, required=True, help="the model's layers")
    parser.add_argument("--num-blocks", type=int, default=MHAR().num_blocks, help="[mhar] num_blocks")
    parser.add_argument("--tokens", type=int, default=2 * 4096, help="tokens a device a step (microbatch x seq)")
    parser.add_argument("--dim", type=int, default=4096, help="the model's width")
    parser.add_argument("--heads", type=int, default=MHAR().num_heads, help="routing heads ([mhar] num_heads)")
    parser.add_argument("--control-tokens-per-s", type=float, required=True, help="the control's, a device")
    parser.add_argument("--copy-tbps", type=float, required=True, help="the card's measured copy bandwidth")
    parser.add_argument("--measured", type=float, default=None, help="a measured MHAR/control to set beside it")
    args = parser.parse_args(argv)
    for name in ("tokens", "dim", "heads", "control_tokens_per_s", "copy_tbps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}")
    if args.measured is not None and not 0 < args.measured <= 1:
        parser.error(f"--measured {args.measured}: an MHAR/control ratio in (0, 1]")
    try:
        floor = step_floor(
            args.layers,
            args.num_blocks,
            args.tokens,
            args.dim,
            args.heads,
            args.control_tokens_per_s,
            args.copy_tbps * 1e12,
        )
    except ValueError as e:
        parser.error(str(e))
    print("\n".join(describe(floor, args.measured)))


if __name__ == "__main__":
    main()
