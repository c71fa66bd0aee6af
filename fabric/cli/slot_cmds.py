"""Commands on a node's slots: promote, pin, unpin, set-active, generate."""

from __future__ import annotations

import argparse

from adapter_fabric.cli.connect import client_for, peer_address
from adapter_fabric.cli.output import emit, pull_note
from adapter_fabric.cli.progress import PullWatcher, on_terminal, run_polled
from adapter_fabric.client.node_client import DEFAULT_MAX_NEW_TOKENS


def cmd_promote(args: argparse.Namespace) -> None:
    show = on_terminal(args.json) and bool(args.peer)
    with client_for(args, timeout=args.timeout) as client:
        source = client_for(args, args.peer) if args.peer else None
        try:
            watcher = PullWatcher(client, source, args.id, f"promote {args.id}", show)
            reply = run_polled(lambda: client.promote(args.id, peer=args.peer or "", name=args.name or "", pin=args.pin), watcher.poll)
            watcher.finish(f"from {reply.source_peer or 'local store'}")
        finally:
            if source is not None:
                source.close()
    # "(evicted X)" sits by the slot it left: after the peer, it read as if the peer had evicted it
    notes = ([f"evicted {reply.evicted_name}"] if reply.evicted_name else []) + (["pinned"] if args.pin else [])
    where = f"into slot {reply.slot}" + (f" ({', '.join(notes)})" if notes else "")
    # without --from it came from the node's own store, unless the node found it (a known peer or an origin)
    moved = f"; {pull_note(reply)}" if args.peer or reply.source_peers else ""
    origin = f"; digest={reply.digest[:16]} origin={reply.origin} revision={reply.revision}" if reply.origin else ""
    emit(args.json, {"adapter_id": args.id, "name": args.name or args.id, **reply.to_dict()}, f"promoted {args.id} as {args.name or args.id} {where}{moved}{origin}")


def _pin(args: argparse.Namespace, pinned: bool) -> None:
    with client_for(args) as client:
        slot = client.pin(args.name, pinned)
    emit(args.json, {"name": args.name, "slot": slot, "pinned": pinned}, f"{'pinned' if pinned else 'unpinned'} {args.name} (slot {slot})")


def cmd_pin(args: argparse.Namespace) -> None:
    _pin(args, True)


def cmd_unpin(args: argparse.Namespace) -> None:
    _pin(args, False)


def cmd_set_active(args: argparse.Namespace) -> None:
    with client_for(args) as client:
        active = client.set_active(args.name)
    emit(args.json, {"name": args.name, **active.to_dict()}, f"{args.name} is active (slot {active.slot}, content_id={active.content_id:#018x})")


MAX_WIRE_INT = (1 << 31) - 1  # token ids travel as int32


def new_tokens(text: str) -> int:
    """``--max-new-tokens``: 1 to 2147483647 (the node refuses more than its own --max-new-tokens by name)."""
    if not text.isdigit() or not 1 <= int(text) <= MAX_WIRE_INT:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number from 1 to {MAX_WIRE_INT}")
    return int(text)


def token_ids(text: str) -> list[int]:
    """``1,2,3`` -> [1, 2, 3]; a usage error naming the item that is not a token id (0 to 2147483647)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("give at least one token id, e.g. --tokens 1,2,3")
    for item in items:
        if not item.isdigit() or int(item) > MAX_WIRE_INT:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not a token id from 0 to {MAX_WIRE_INT} (e.g. --tokens 1,2,3)")
    return [int(t) for t in items]


def cmd_generate(args: argparse.Namespace) -> None:
    with client_for(args) as client:
        result = client.generate(args.tokens, args.adapter or "", use_base=args.base, max_new_tokens=args.max_new_tokens)
    emit(args.json, result.to_dict(), f"slot {result.slot} content_id={result.content_id:#018x}: {result.output_ids}")


def register(command) -> None:
    """Add this module's subcommands through ``command(name, handler, help)`` (see ``adapter_fabric.cli.main``)."""
    p = command("promote", cmd_promote, "load an adapter into a slot of a node, pulling it from a peer (and the swarm) if given", long=True)
    p.add_argument("--from", dest="peer", type=peer_address, help="host:port of a peer that has the adapter (omit: the node finds it: held, the id's homes (with --homes 0: its known peers), then its --origin list)")
    p.add_argument("--id", required=True, help="adapter id")
    p.add_argument("--name", help="name requests will use (default: the id)")
    p.add_argument("--pin", action="store_true", help="pin the slot against eviction (refused, evicting nothing, past the pin limit of slots - 1)")

    for name, handler, what in (("pin", cmd_pin, "pin a resident adapter against eviction (at most slots - 1)"), ("unpin", cmd_unpin, "let a resident adapter be evicted again")):
        p = command(name, handler, what)
        p.add_argument("--name", required=True, help="the resident adapter's name")

    p = command("set-active", cmd_set_active, "make a resident adapter the node's active one (used when a request names none)")
    p.add_argument("--name", required=True, help="the resident adapter's name")

    p = command("generate", cmd_generate, "run the model on token ids with an adapter (greedy)")
    p.add_argument("--adapter", help="resident adapter name (default: the active one)")
    p.add_argument("--base", action="store_true", help="use the base model, no adapter")
    p.add_argument("--tokens", required=True, type=token_ids, help="comma-separated input token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=new_tokens, default=DEFAULT_MAX_NEW_TOKENS, help="greedy tokens to generate (default: %(default)s, as NodeClient.generate)")
