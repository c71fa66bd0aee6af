"""Commands that need no node: demo, make-adapter."""

from __future__ import annotations

import argparse
import json
import secrets
from pathlib import Path

from adapter_fabric.cli.output import emit
from adapter_fabric.cli.paths import make_directory


def cmd_demo(args: argparse.Namespace) -> None:
    from adapter_fabric.harness.demo import run_demo

    if args.workdir:
        make_directory(args.workdir, "--workdir")

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


#: lora_alpha past this is a typo (alpha / r scales every delta; PEFT's configs use up to a few hundred)
MAX_ALPHA = 1e6
#: seeds are whole numbers from 0 to this (what every RNG a reader might reuse accepts)
MAX_SEED = 2**32 - 1


def lora_alpha(text: str) -> float:
    """``--alpha``: a finite positive number up to MAX_ALPHA (nan, inf or -3 wrote a config no node accepts)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_ALPHA:  # false for nan too
        raise argparse.ArgumentTypeError(f"{text!r}: expected a lora_alpha above 0 and at most {MAX_ALPHA:g}")
    return value


def seed(text: str) -> int:
    """``--seed``: a whole number from 0 to MAX_SEED."""
    if not text.isdigit() or int(text) > MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a seed from 0 to {MAX_SEED}")
    return int(text)


def cmd_make_adapter(args: argparse.Namespace) -> None:
    import warnings

    from adapter_fabric.errors import InvalidArgument
    from adapter_fabric.serving.tiny import TINY_PRESETS, load_base_model, make_peft_adapter

    out = Path(args.dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidArgument(f"{out} exists and is not an empty directory: give a new directory")
    if args.model not in TINY_PRESETS and not Path(args.model).is_dir():
        raise InvalidArgument(f"--model {args.model!r} is neither a built-in model ({', '.join(TINY_PRESETS)}) nor a local model directory")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers deprecation notices, not ours
    targets = [t.strip() for t in args.targets.split(",") if t.strip()] if args.targets != "all-linear" else "all-linear"
    base = load_base_model(args.model)
    check_targets(base, targets)  # PEFT itself refuses only a list that matches nothing: q_proj,nope_proj went through
    make_directory(out, "make-adapter DIR")
    # random unless --seed says otherwise (the seed is printed: --seed with it makes the same weights again)
    weights_seed = args.seed if args.seed is not None else secrets.randbelow(MAX_SEED + 1)
    try:
        make_peft_adapter(out, base_model=base, r=args.rank, lora_alpha=args.alpha, target_modules=targets, seed=weights_seed)
    except ValueError as exc:  # PEFT's refusal, e.g. a --targets module the model lacks
        raise InvalidArgument(f"--model {args.model} cannot take this adapter: {str(exc).splitlines()[0][:300]}") from None
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    # A model built in code has no name; engines (vLLM's resolvers) match adapters to their model by this field.
    config["base_model_name_or_path"] = args.base_model_name or config.get("base_model_name_or_path") or args.model
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    payload = {"dir": str(out), "model": args.model, "r": args.rank, "lora_alpha": args.alpha, "seed": weights_seed, "base_model_name_or_path": config["base_model_name_or_path"]}
    emit(args.json, payload, f"made {out} (PEFT LoRA r={args.rank} for --model {args.model}, seed {weights_seed})")


def check_targets(base, targets: list[str] | str) -> None:
    """``InvalidArgument`` naming each ``--targets`` module that is no linear module of ``base``, and the ones it has."""
    import torch

    from adapter_fabric.errors import InvalidArgument

    linear = sorted({name.rsplit(".", 1)[-1] for name, module in base.named_modules() if isinstance(module, torch.nn.Linear)})
    unknown = [t for t in targets if t not in linear] if isinstance(targets, list) else []
    if not targets or unknown:
        raise InvalidArgument(f"--targets: {', '.join(unknown) or 'none given'}: not a linear module of the model; expected some of {', '.join(linear)}, or all-linear")


def register(command) -> None:
    """Add this module's subcommands through ``command(name, handler, help, node=False)`` (see ``adapter_fabric.cli.main``)."""
    p = command("demo", cmd_demo, "start a local 3-node cluster on the tiny model and move adapters across it", node=False)
    p.add_argument("--workdir", help="where node stores and logs go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory afterwards")

    p = command("make-adapter", cmd_make_adapter, "write a random PEFT LoRA adapter (save_pretrained) that fits a node's --model", node=False)
    p.add_argument("dir", help="new directory to write adapter_config.json and adapter_model.safetensors into")
    p.add_argument("--model", default="tiny", help="the node's --model: tiny, tiny-mistral, tiny-qwen2 or a local model directory (default: %(default)s)")
    p.add_argument("--rank", type=lora_rank, default=8, help="LoRA rank r (default: %(default)s)")
    p.add_argument("--alpha", type=lora_alpha, default=16.0, help=f"lora_alpha, above 0 and at most {MAX_ALPHA:g} (default: %(default)g)")
    p.add_argument("--targets", default="q_proj,v_proj", help="comma-separated modules, or all-linear (default: %(default)s)")
    p.add_argument("--seed", type=seed, default=None, help=f"seed of the random weights, 0 to {MAX_SEED}: the same seed and flags make the same adapter, "
                   "byte for byte (default: a random seed, printed)")
    p.add_argument("--base-model-name", help="base_model_name_or_path to record (default: --model); vLLM matches it to its served model")
