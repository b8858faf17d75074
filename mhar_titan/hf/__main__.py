"""The command line for HF checkpoints: inspect one, export a run's checkpoint, write a random base.

python -m mhar_titan.hf inspect PATH [--mhar [--num-blocks N] [--num-heads H]]
python -m mhar_titan.hf export RUN_DIR OUT_DIR [--step N] [--ema] [--dtype bf16] [--device cpu]
python -m mhar_titan.hf init OUT_DIR [--flavor tiny|CHECKPOINT_DIR] [--layers N] [--tokenizer DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys

from data.store import StoreError
from mhar_titan.hf.export import init_hf
from mhar_titan.hf.files import DTYPES
from mhar_titan.hf.load import inspect
from mhar_titan.hf.run import export_run
from mhar_titan.model.args import MHAR


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p_inspect = sub.add_parser(
        "inspect",
        help="config summary, parameter count, load ledger",
        description="An HF checkpoint's config summary, parameter count and load ledger (as the control, or "
        "with --mhar as the MHAR arm, would load it).",
    )
    p_inspect.add_argument("path", help="an HF checkpoint folder (config.json and safetensors)")
    p_inspect.add_argument("--mhar", action="store_true", help="as the MHAR arm would load it")
    p_inspect.add_argument(
        "--num-blocks", type=int, default=MHAR.num_blocks, help="with --mhar: [mhar] num_blocks (divides the layers)"
    )
    p_inspect.add_argument("--num-heads", type=int, default=MHAR.num_heads, help="with --mhar: [mhar] num_heads")


def _add_export(sub: argparse._SubParsersAction) -> None:
    p_export = sub.add_parser(
        "export",
        help="a run's checkpoint as an HF directory (streamed, one shard at a time)",
        description="A run's checkpoint as an HF directory, streamed one output shard at a time (the MHAR arm "
        "as its own model type, read with trust_remote_code=True).",
    )
    p_export.add_argument("run_dir", help="the run's dump_folder (holds model_args.json and checkpoint/)")
    p_export.add_argument("out_dir", help="a new folder for the HF model")
    p_export.add_argument("--step", type=int, default=None, help="default: the latest complete checkpoint")
    p_export.add_argument("--ema", action="store_true", help="the EMA weights instead of the raw ones")
    p_export.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the exported weights' dtype")
    p_export.add_argument("--device", default="cpu", help="where tensors are cast and permuted (cpu, cuda)")
    p_export.add_argument("--no-verify", action="store_true", help="skip checking the files against their checksums")
    p_export.add_argument("--no-routing", action="store_true", help="plain Llama (only while every gate is 0)")


def _add_init(sub: argparse._SubParsersAction) -> None:
    p_init = sub.add_parser(
        "init",
        help="a randomly initialised base checkpoint of a flavor",
        description="A randomly initialised HF base checkpoint of a built-in flavor (make demo's base).",
    )
    p_init.add_argument("out_dir", help="a new folder for the HF model")
    p_init.add_argument(
        "--flavor",
        default="tiny",
        help="a built-in architecture (tiny, marin8b, ...; default tiny) or an HF checkpoint folder (its config.json)",
    )
    p_init.add_argument("--layers", type=int, default=None, help="the depth, if not the architecture's own")
    p_init.add_argument("--tokenizer", default=None, help="folder whose tokenizer files are copied in")
    p_init.add_argument("--seed", type=int, default=0, help="the initialisation's random seed (default 0)")
    p_init.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="the saved weights' dtype")
    p_init.add_argument("--device", default="cpu", help="where to initialise (cuda: an 8B model in seconds)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mhar_titan.hf",
        description="HF checkpoints for mhar-titan: inspect one, export a run's checkpoint as one, write a random one.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_inspect(sub)
    _add_export(sub)
    _add_init(sub)
    return parser


def _init(args: argparse.Namespace) -> None:
    try:
        init_hf(
            args.out_dir,
            args.flavor,
            args.tokenizer,
            args.seed,
            DTYPES[args.dtype],
            args.device,
            layers=args.layers,
        )
    except (FileNotFoundError, FileExistsError, ValueError, StoreError) as e:  # bad input, a store: one line
        sys.exit(f"python -m mhar_titan.hf init: {e}")
    depth = f", {args.layers} layers" if args.layers else ""
    print(f"wrote a random {args.flavor}{depth} base checkpoint (seed {args.seed}, {args.dtype}) to {args.out_dir}")


def _inspect(args: argparse.Namespace) -> None:
    mhar = MHAR(enable=True, num_blocks=args.num_blocks, num_heads=args.num_heads) if args.mhar else None
    try:
        print(inspect(args.path, mhar))
    except (FileNotFoundError, ValueError) as e:  # bad input: one line, no traceback
        hint = " (set --num-blocks)" if "num_blocks" in str(e) else ""
        sys.exit(f"python -m mhar_titan.hf inspect: {e}{hint}")


def _log_line(line: str) -> None:
    """Export progress on stdout, its warnings on stderr, each as it happens."""
    print(line, file=sys.stderr if line.startswith("warning") else sys.stdout, flush=True)


def _export(args: argparse.Namespace) -> None:
    try:
        step_dir = export_run(
            args.run_dir,
            args.out_dir,
            step=args.step,
            ema=args.ema,
            dtype=DTYPES[args.dtype],
            device=args.device,
            include_routing=not args.no_routing,
            verify=not args.no_verify,
            log=_log_line,
        )
    except (FileNotFoundError, FileExistsError, ValueError, StoreError) as e:  # bad input, a store: one line
        sys.exit(f"python -m mhar_titan.hf export: {e}")
    print(f"exported {step_dir} ({'EMA' if args.ema else 'raw'} weights) to {args.out_dir} ({args.dtype})")


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.cmd == "init":
        _init(args)
    elif args.cmd == "inspect":
        _inspect(args)
    elif args.cmd == "export":
        _export(args)


if __name__ == "__main__":
    main(sys.argv[1:])
