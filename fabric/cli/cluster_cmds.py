"""Commands over several nodes: health, wait, rollout."""

from __future__ import annotations

import argparse
import time

from adapter_fabric.cli.connect import client_for, duration_arg, node_address, peer_address
from adapter_fabric.cli.output import emit
from adapter_fabric.cli.progress import PullWatcher, on_terminal, run_polled
from adapter_fabric.client.rollout import NodeRollout
from adapter_fabric.exit_codes import EXIT_RETRYABLE


def cmd_health(args: argparse.Namespace) -> None:
    with client_for(args) as client:
        status = client.health()
    emit(args.json, {"node": args.node, "status": status}, f"{args.node} {status}")
    if status != "SERVING":
        raise SystemExit(EXIT_RETRYABLE)


def cmd_wait(args: argparse.Namespace) -> None:
    nodes = [args.node, *args.nodes]
    deadline = time.monotonic() + args.timeout if args.timeout else None
    waited: dict[str, float] = {}
    t0 = time.monotonic()
    for node in nodes:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with client_for(args, node) as client:
            client.wait_serving(timeout=left)
        waited[node] = round(time.monotonic() - t0, 3)
    emit(args.json, {"serving": nodes, "seconds": waited}, "\n".join(f"{n} SERVING" for n in nodes))


def cmd_rollout(args: argparse.Namespace) -> None:
    from adapter_fabric.client.rollout import rollout

    nodes = [args.node, *args.nodes]
    show = on_terminal(args.json)
    watchers: dict[str, PullWatcher] = {}
    finished: dict[str, NodeRollout] = {}
    if show:
        seed = client_for(args, args.peer)
        for i, node in enumerate(nodes):
            watchers[node] = PullWatcher(client_for(args, node), seed, args.id, f"{node:<21}", True, position=i)
        seed.close()

    def poll() -> None:
        for node, watcher in list(watchers.items()):
            result = finished.get(node)
            if result is None:
                watcher.poll()
            else:
                # a failure's reason is long: the bar says FAILED, the result lines below say why in full
                note = f"{result.seconds:.2f} s from {','.join(result.source_peers) or '-'}" if result.ok else "FAILED (why: below)"
                watcher.finish(note, ok=result.ok)
                watcher.node.close()
                del watchers[node]

    results = run_polled(
        lambda: rollout(
            nodes,
            args.id,
            args.peer,
            name=args.name or "",
            stage_only=args.stage_only,
            named_peer_only=args.no_swarm,
            client_for=lambda node: client_for(args, node, timeout=args.timeout),
            on_done=lambda r: finished.__setitem__(r.node, r),
        ),
        poll,
    )
    poll()
    ok = [r for r in results if r.ok]
    slowest = max((r.seconds for r in ok), default=0.0)
    lines = [
        f"  {r.node:<24} {r.seconds:7.2f} s  {r.bytes_transferred:>11} B  from {','.join(r.source_peers) or '-'}" if r.ok else f"  {r.node:<24} FAILED: {r.error}"
        for r in results
    ]
    lines.append(f"rolled out {args.id} on {len(ok)} of {len(results)} nodes; slowest {slowest:.2f} s")
    emit(args.json, {"adapter_id": args.id, "seed": args.peer, "slowest_seconds": slowest, "nodes": [r.to_dict() for r in results]}, "\n".join(lines))
    failed = [r for r in results if not r.ok]
    if failed:  # exit like the worst node: 1 if any refusal is permanent, else 3
        raise SystemExit(EXIT_RETRYABLE if all(r.retryable for r in failed) else 1)


def cmd_whoami(args: argparse.Namespace) -> None:
    with client_for(args) as client:
        who = client.whoami()
    grants = [f"  {','.join(g.verbs)} on {' '.join(g.prefixes)}" for g in who.grants]
    where = "" if who.policy else " (the node runs without --policy: every authenticated caller may do everything)"
    emit(args.json, who.to_dict(), "\n".join([f"principal {who.principal}{where}", *grants]))


def register(command) -> None:
    """Add this module's subcommands through ``command(name, handler, help)`` (see ``adapter_fabric.cli.main``)."""
    command("health", cmd_health, "a node's gRPC health: SERVING (exit 0) or not (exit 3)")
    command("whoami", cmd_whoami, "who this command's credentials (token or client certificate) are to a node: its principal and grants")

    p = command("wait", cmd_wait, "wait until every listed node answers health SERVING (scripts run this before their first call)")
    p.add_argument("nodes", nargs="*", metavar="NODE", type=node_address, help="more nodes (host:port)")
    p.add_argument("--timeout", type=duration_arg, default=120.0, help="how long to wait for all of them: 30s, 2m (plain numbers are seconds); 0 = forever (default: 2m)")

    p = command("rollout", cmd_rollout, "promote one adapter on many nodes at once (they share chunks as they arrive); prints each node's time", long=True)
    p.add_argument("nodes", nargs="*", metavar="NODE", type=node_address, help="more nodes (host:port)")
    p.add_argument("--id", required=True, help="adapter id")
    p.add_argument("--from", dest="peer", required=True, type=peer_address, help="host:port of a seed that has the adapter")
    p.add_argument("--name", help="name requests will use (default: the id)")
    p.add_argument("--stage-only", action="store_true", help="pull into each node's store without loading a slot (store-only nodes)")
    p.add_argument("--no-swarm", action="store_true", help="every node pulls from the seed alone (a baseline)")


