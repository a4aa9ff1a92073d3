"""The ``paro`` command line: ``paro plan`` prints the cost model's estimate for every PaRO strategy.

The numbers all come from the Rust cost model (``paro_torch._C.estimate``); this module only parses arguments,
converts units (GB, GB/s, µs) and formats the report.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any

from paro_torch import _C
from paro_torch._report import format_report

GB = 1e9
"""Bytes per GB as the report prints it (decimal, as in the paper's tables)."""

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads")


class CliError(Exception):
    """A bad argument or input file; reported on stderr with exit code 2."""


def main(argv: list[str] | None = None) -> int:
    """Runs the ``paro`` command line.

    Args:
        argv: The arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit code: 0 on success, 2 for bad arguments, unreadable files or sizes the cost model rejects.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.run(args))
    except (CliError, ValueError) as err:
        print(f"paro {args.command}: error: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paro", description="PaRO (arXiv 2310.06003) tools.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    plan = commands.add_parser(
        "plan",
        help="estimate memory, communication and step time of every strategy and pick one",
        description=(
            "Estimates, for each of the 14 PaRO strategies, the memory per rank, the communication per training "
            "step and the predicted step time (compute, exposed communication, optimizer), and names the strategy "
            "`auto` picks: the fastest that fits."
        ),
    )
    model = plan.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--model",
        metavar="NAME|CONFIG",
        help="a preset (llama-7b, llama-13b, llama-30b, llama-65b) or the config.json of a LLaMA-style model",
    )
    model.add_argument("--params", metavar="N", type=_count, help="a bare parameter count, e.g. 7e9, 7B, 65.2b")
    plan.add_argument(
        "--blocks", metavar="N", type=int, help="with --params: cut the count into N equal blocks (wrapped layers)"
    )
    plan.add_argument(
        "--trainable",
        metavar="X",
        type=_trainable,
        help="trainable part: a fraction (1/16, 0.003) or, above 1, a count (1e8, 100M); default all",
    )
    ranks = plan.add_mutually_exclusive_group()
    ranks.add_argument("--nodes", metavar="N", type=int, default=1, help="number of groups; world = nodes x group size")
    ranks.add_argument("--world", metavar="N", type=int, help="total number of ranks, instead of --nodes")
    plan.add_argument("--group-size", metavar="M", type=int, default=8, help="ranks per group (default 8)")
    plan.add_argument(
        "--gpu",
        choices=_C.GPU_PRESETS,
        default="a100",
        help="GPU class: its memory, NVLink bandwidth, bf16 compute and optimizer speed (default a100)",
    )
    plan.add_argument(
        "--inter-gbit", metavar="GBIT/S", type=float, default=100.0, help="per GPU between groups (default 100)"
    )
    plan.add_argument(
        "--efficiency", metavar="F", type=float, default=0.5, help="fraction of the bf16 peak reached (default 0.5)"
    )
    plan.add_argument("--gpu-memory", metavar="GB", type=float, help="memory per rank (default: the GPU's)")
    plan.add_argument("--intra-bandwidth", metavar="GB/S", type=float, help="per rank, inside a group")
    plan.add_argument("--inter-bandwidth", metavar="GB/S", type=float, help="per rank, across groups")
    plan.add_argument("--intra-latency", metavar="US", type=float, help="per ring step, µs (default 5)")
    plan.add_argument("--inter-latency", metavar="US", type=float, help="per ring step, µs (default 20)")
    plan.add_argument(
        "--unpack-bandwidth",
        metavar="GB/S",
        type=float,
        help="copy-out of gathered parameters into their storage, per rank (default: not counted)",
    )
    plan.add_argument("--micro-batch", metavar="B", type=int, help="sequences per micro-step per rank")
    plan.add_argument("--seq-len", metavar="S", type=int, help="tokens per sequence")
    plan.add_argument("--grad-accum", metavar="A", type=int, help="micro-steps per optimizer step")
    plan.add_argument(
        "--no-activation-checkpointing",
        dest="activation_checkpointing",
        action="store_false",
        default=None,
        help="keep all activations instead of recomputing each layer",
    )
    plan.add_argument(
        "--clip-grad-norm", action="store_true", default=None, help="each step clips the gradients' global norm"
    )
    plan.add_argument(
        "--collectives",
        choices=("flat", "hierarchical", "phased"),
        default="hierarchical",
        help="global collectives as one ring over all ranks, intra + inter phases pipelined as the paro backend "
        "runs them, or the same phases one after the other as ParoShardedModule issues them",
    )
    plan.add_argument(
        "--strategies", metavar="LIST", help="comma-separated codes or aliases to consider, e.g. IIG,III,zero3"
    )
    plan.add_argument("--json", action="store_true", help="print the cost model's report as JSON")
    plan.set_defaults(run=_plan)
    return parser


def _plan(args: argparse.Namespace) -> int:
    """Runs ``paro plan``: builds the request, calls the cost model and prints its report."""
    request = _request(args)
    report = json.loads(_C.estimate(json.dumps(request)))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def _request(args: argparse.Namespace) -> dict[str, Any]:
    """Turns the parsed arguments into a cost-model request (bytes, bytes/s, seconds)."""
    if args.blocks is not None and args.params is None:
        raise CliError("--blocks only applies to --params")
    if args.model is not None:
        model: dict[str, Any] = _model(args.model)
    else:
        model = {"params": args.params}
        if args.blocks is not None:
            model["num_blocks"] = args.blocks
    world = args.world if args.world is not None else args.nodes * args.group_size
    for name, value in (("world", world), ("group size", args.group_size)):
        if value < 0:
            raise CliError(f"{name} must not be negative")
    cluster = json.loads(_C.gpu_cluster(args.gpu, world, args.group_size, args.inter_gbit, args.efficiency))
    for key, value, unit in (
        ("memory_bytes", args.gpu_memory, GB),
        ("intra_bandwidth", args.intra_bandwidth, GB),
        ("inter_bandwidth", args.inter_bandwidth, GB),
        ("intra_latency", args.intra_latency, 1e-6),
        ("inter_latency", args.inter_latency, 1e-6),
        ("unpack_bandwidth", args.unpack_bandwidth, GB),
    ):
        if value is not None:
            cluster[key] = round(value * unit) if key == "memory_bytes" else value * unit
    request: dict[str, Any] = {
        "model": model,
        "cluster": cluster,
        "training": {
            key: value
            for key, value in (
                ("grad_accum", args.grad_accum),
                ("micro_batch", args.micro_batch),
                ("seq_len", args.seq_len),
                ("activation_checkpointing", args.activation_checkpointing),
                ("clip_grad_norm", args.clip_grad_norm),
            )
            if value is not None
        },
        "collectives": args.collectives,
    }
    if args.trainable is not None:
        request["trainable"] = args.trainable
    if args.strategies is not None:
        request["strategies"] = [name.strip() for name in args.strategies.split(",") if name.strip()]
    return request


def _model(value: str) -> dict[str, Any]:
    """A preset name, or the shape read from a Hugging Face config.json."""
    path = Path(value)
    if not (value.endswith(".json") or path.exists() or "/" in value):
        return {"preset": value}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"cannot read model config {value}: {err}") from err
    except json.JSONDecodeError as err:
        raise CliError(f"model config {value} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise CliError(f"model config {value} must hold a JSON object")
    missing = [key for key in _SHAPE_KEYS if key not in config]
    if missing:
        raise CliError(f"model config {value} lacks {', '.join(missing)}; is it a LLaMA-style config.json?")
    shape: dict[str, Any] = {}
    for key in (*_SHAPE_KEYS, "num_key_value_heads"):
        number = config.get(key)
        if number is None:
            continue
        if isinstance(number, bool) or not isinstance(number, int):
            raise CliError(f"model config {value}: {key} must be a whole number (got {number!r})")
        shape[key] = number
    tie = config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise CliError(f"model config {value}: tie_word_embeddings must be true or false (got {tie!r})")
    shape["tie_word_embeddings"] = tie
    return {"shape": shape}


def _count(text: str) -> int:
    """A whole count such as 7e9, 7B, 65.2b or 100M (k, M, B or G, T suffixes)."""
    match = _NUMBER.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; write e.g. 7e9, 7B or 6738415616")
    try:
        value = Decimal(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    except InvalidOperation as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count") from err
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def _trainable(text: str) -> dict[str, float | int]:
    """A fraction (1/16, 0.003, 1) or, above 1 or with a suffix, a count (1e8, 100M)."""
    if "/" in text:
        num, _, den = text.partition("/")
        try:
            fraction = Fraction(int(num), int(den))
        except (ValueError, ZeroDivisionError) as err:
            raise argparse.ArgumentTypeError(f"{text!r} is not a fraction like 1/16") from err
        if not 0 <= fraction <= 1:
            raise argparse.ArgumentTypeError(f"fraction {text} must be between 0 and 1")
        return {"fraction": float(fraction)}
    match = _NUMBER.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a fraction (1/16, 0.003) nor a count (1e8, 100M)")
    if match.group(2) or Decimal(match.group(1)) > 1:
        return {"count": _count(text)}
    return {"fraction": float(match.group(1))}


if __name__ == "__main__":
    sys.exit(main())
