"""Commands that need no node: demo, make-adapter."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adapter_fabric.cli.output import emit


def cmd_demo(args: argparse.Namespace) -> None:
    from adapter_fabric.harness.demo import run_demo

    if args.json:  # the demo narrates as it goes; JSON gets the outcome alone
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()) as narration:
            code = run_demo(workdir=args.workdir, keep=args.keep)
        emit(True, {"ok": code == 0, "log": narration.getvalue().splitlines()}, "")
    else:
        code = run_demo(workdir=args.workdir, keep=args.keep)
    raise SystemExit(code)


def lora_rank(text: str) -> int:
    """``--rank``: a LoRA rank, 1 to 1024."""
    if not text.isdigit() or not 1 <= int(text) <= 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a LoRA rank from 1 to 1024")
    return int(text)


def cmd_make_adapter(args: argparse.Namespace) -> None:
    import warnings

    from adapter_fabric.errors import InvalidArgument
    from adapter_fabric.serving.tiny import TINY_PRESETS, load_base_model, make_peft_adapter

    out = Path(args.dir)
    if out.exists() and any(out.iterdir()):
        raise InvalidArgument(f"{out} exists and is not empty: give a new directory")
    if args.model not in TINY_PRESETS and not Path(args.model).is_dir():
        raise InvalidArgument(f"--model {args.model!r} is neither a built-in model ({', '.join(TINY_PRESETS)}) nor a local model directory")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers deprecation notices, not ours
    targets = [t for t in args.targets.split(",") if t] if args.targets != "all-linear" else "all-linear"
    try:
        make_peft_adapter(out, base_model=load_base_model(args.model), r=args.rank, lora_alpha=args.alpha, target_modules=targets, seed=args.seed)
    except ValueError as exc:  # PEFT's refusal, e.g. a --targets module the model lacks
        raise InvalidArgument(f"--model {args.model} cannot take this adapter: {str(exc).splitlines()[0][:300]}") from None
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    # A model built in code has no name; engines (vLLM's resolvers) match adapters to their model by this field.
    config["base_model_name_or_path"] = args.base_model_name or config.get("base_model_name_or_path") or args.model
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    emit(args.json, {"dir": str(out), "model": args.model, "r": args.rank, "lora_alpha": args.alpha, "base_model_name_or_path": config["base_model_name_or_path"]}, f"made {out} (PEFT LoRA r={args.rank} for --model {args.model})")


def register(command) -> None:
    """Add this module's subcommands through ``command(name, handler, help, node=False)`` (see ``adapter_fabric.cli.main``)."""
    p = command("demo", cmd_demo, "start a local 3-node cluster on the tiny model and move adapters across it", node=False)
    p.add_argument("--workdir", help="where node stores and logs go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory afterwards")

    p = command("make-adapter", cmd_make_adapter, "write a random PEFT LoRA adapter (save_pretrained) that fits a node's --model", node=False)
    p.add_argument("dir", help="new directory to write adapter_config.json and adapter_model.safetensors into")
    p.add_argument("--model", default="tiny", help="the node's --model: tiny, tiny-mistral, tiny-qwen2 or a local model directory (default: %(default)s)")
    p.add_argument("--rank", type=lora_rank, default=8, help="LoRA rank r (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=16, help="lora_alpha (default: %(default)s)")
    p.add_argument("--targets", default="q_proj,v_proj", help="comma-separated modules, or all-linear (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1, help="random seed of the weights (default: %(default)s)")
    p.add_argument("--base-model-name", help="base_model_name_or_path to record (default: --model); vLLM matches it to its served model")
