"""``fabric``: the command line of adapter-fabric.

    fabric stage NODE DIR --id ID          upload a PEFT directory (resumable, with a progress bar; --sign-key KEY signs it)
    fabric keygen OUT                       an Ed25519 key pair for signing adapters (OUT.key, OUT.pub)
    fabric sign DIR --key KEY               an adapter directory's digest and its signature
    fabric promote NODE --from PEER --id ID --name NAME
    fabric ls NODE                          staged adapters and resident slots
    fabric generate NODE --adapter NAME --tokens 1,2,3
    fabric unstage NODE --id ID
    fabric rollout NODE... --id ID --from SEED  promote on many nodes at once (a swarm), each node timed
    fabric demo                             a local 3-node cluster on the tiny model

Every command but demo takes --json for scripts, and --tls-ca/--tls-cert/--tls-key/
--auth-token-file (or FABRIC_TLS_CA, ... FABRIC_AUTH_TOKEN_FILE) for a secure cluster. Errors print one line naming
the problem and exit with status 1 (2 for usage errors).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from google.protobuf.json_format import MessageToDict

from fabric.errors import FabricError
from fabric.cli.sign import add_sign_commands


def _print(args: argparse.Namespace, message, human: str) -> None:
    if args.json:
        payload = message if isinstance(message, dict) else MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        print(json.dumps(payload, indent=2, sort_keys=True))
    else:
        print(human)


def _client(args: argparse.Namespace):
    from fabric.client.node_client import NodeClient
    from fabric.rpc.security import TlsFiles, check_token, read_token

    tls = TlsFiles(_path(args.tls_cert), _path(args.tls_key), _path(args.tls_ca))
    if args.auth_token_file:
        token = read_token(args.auth_token_file)
    elif os.environ.get("FABRIC_AUTH_TOKEN"):
        token = check_token(os.environ["FABRIC_AUTH_TOKEN"], "FABRIC_AUTH_TOKEN")
    else:
        token = None
    return NodeClient(args.node, tls=tls if tls.enabled else None, token=token)


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def cmd_stage(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    with _client(args) as client, tqdm(total=0, unit="B", unit_scale=True, desc=f"stage {args.id}", disable=args.json or None, file=sys.stderr) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        sign_key = Path(args.sign_key).read_bytes() if args.sign_key else None
        reply = client.stage(args.dir, args.id, progress=progress, sign_key=sign_key)
    note = " (already staged)" if reply.already_staged else ""
    _print(args, reply, f"staged {reply.adapter_id} digest={reply.digest} content_id={reply.content_id:#018x}{note}")


def cmd_promote(args: argparse.Namespace) -> None:
    with _client(args) as client:
        reply = client.promote(args.id, peer=args.peer or "", name=args.name or "", pin=args.pin)
    evicted = f", evicted {reply.evicted_name}" if reply.evicted_name else ""
    source = f" from {reply.source_peer} ({reply.bytes_transferred} bytes)" if reply.source_peer else ""
    _print(args, reply, f"promoted {args.id} as {args.name or args.id} into slot {reply.slot}{evicted}{source}")


def cmd_ls(args: argparse.Namespace) -> None:
    with _client(args) as client:
        reply = client.list()
    lines = [f"staged ({len(reply.staged)}):"]
    for a in reply.staged:
        damage = f"  DAMAGED: {a.damaged}" if a.damaged else ""
        lines.append(f"  {a.adapter_id:<32} {a.digest[:16]}  {a.size:>10} B  r={a.peft.r} alpha={a.peft.lora_alpha:g}{damage}")
    if reply.slots:
        lines.append(f"slots (device {reply.device}, max rank {reply.max_rank}):")
        for s in reply.slots:
            flags = "".join(f for f, on in (("*", s.active), ("P", s.pinned)) if on)
            name = s.name or "-"
            lines.append(f"  [{s.slot}] {name:<24} id={s.content_id:#018x} refs={s.ref_count} rank={s.rank} last_use={s.last_used} {flags}")
    _print(args, reply, "\n".join(lines))


def cmd_generate(args: argparse.Namespace) -> None:
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    with _client(args) as client:
        result = client.generate(tokens, args.adapter or "", use_base=args.base, max_new_tokens=args.max_new_tokens)
    _print(args, result.__dict__, f"slot {result.slot} content_id={result.content_id:#018x}: {result.output_ids}")


def cmd_unstage(args: argparse.Namespace) -> None:
    with _client(args) as client:
        removed = client.unstage(args.id)
    _print(args, {"adapter_id": args.id, "bytes_removed": removed}, f"unstaged {args.id}" + ("" if removed else " (bytes kept: another id refers to them)"))


def _timed_client(args: argparse.Namespace, node: str):
    client = _client(argparse.Namespace(**{**vars(args), "node": node}))
    client.timeout = args.timeout  # a rollout of a large adapter may take longer than one call's default
    return client


def cmd_rollout(args: argparse.Namespace) -> None:
    from fabric.client.rollout import rollout

    nodes = [args.node, *args.nodes]
    results = rollout(
        nodes,
        args.id,
        args.peer,
        name=args.name or "",
        stage_only=args.stage_only,
        named_peer_only=args.no_swarm,
        client_for=lambda node: _timed_client(args, node),
    )
    ok = [r for r in results if r.ok]
    slowest = max((r.seconds for r in ok), default=0.0)
    lines = [
        f"  {r.node:<24} {r.seconds:7.2f} s  {r.bytes_transferred:>11} B  from {','.join(r.source_peers) or '-'}"
        if r.ok
        else f"  {r.node:<24} FAILED: {r.error}"
        for r in results
    ]
    lines.append(f"rolled out {args.id} on {len(ok)} of {len(results)} nodes; slowest {slowest:.2f} s")
    _print(args, {"adapter_id": args.id, "seed": args.peer, "slowest_seconds": slowest, "nodes": [r.to_dict() for r in results]}, "\n".join(lines))
    if len(ok) < len(results):
        raise SystemExit(1)


def cmd_demo(args: argparse.Namespace) -> None:
    from fabric.harness.demo import run_demo

    raise SystemExit(run_demo(workdir=args.workdir, keep=args.keep))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fabric", description="Move LoRA adapters between adapter-fabric nodes and serve them.")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, handler, help: str, node: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        if node:
            p.add_argument("node", help="the node's host:port")
            p.add_argument("--json", action="store_true", help="print the reply as JSON")
            g = p.add_argument_group("security (each also from its environment variable)")
            g.add_argument("--tls-ca", default=os.environ.get("FABRIC_TLS_CA"), help="PEM CA that signed the node's certificate: turns on TLS [FABRIC_TLS_CA]")
            g.add_argument("--tls-cert", default=os.environ.get("FABRIC_TLS_CERT"), help="PEM client certificate, for nodes that require mutual TLS [FABRIC_TLS_CERT]")
            g.add_argument("--tls-key", default=os.environ.get("FABRIC_TLS_KEY"), help="PEM key of --tls-cert [FABRIC_TLS_KEY]")
            g.add_argument("--auth-token-file", default=os.environ.get("FABRIC_AUTH_TOKEN_FILE"), help="file with the cluster's bearer token [FABRIC_AUTH_TOKEN_FILE; or the token itself in FABRIC_AUTH_TOKEN]")
        p.set_defaults(handler=handler)
        return p

    p = command("stage", cmd_stage, "upload a PEFT adapter directory to a node (resumes an interrupted upload)")
    p.add_argument("dir", help="directory with adapter_config.json and adapter_model.safetensors")
    p.add_argument("--id", required=True, help="adapter id, e.g. team-a/support-v3")
    p.add_argument("--sign-key", help="sign the adapter's digest with this Ed25519 private key (fabric keygen); the signature travels with it")

    p = command("promote", cmd_promote, "load an adapter into a slot of a node, pulling it from a peer if given")
    p.add_argument("--from", dest="peer", help="host:port of a peer that has the adapter (omit: already staged on the node)")
    p.add_argument("--id", required=True, help="adapter id")
    p.add_argument("--name", help="name requests will use (default: the id)")
    p.add_argument("--pin", action="store_true", help="pin the slot so it is never evicted")

    add_sign_commands(sub)
    command("ls", cmd_ls, "list staged adapters and resident slots")

    p = command("generate", cmd_generate, "run the model on token ids with an adapter (greedy)")
    p.add_argument("--adapter", help="resident adapter name (default: the active one)")
    p.add_argument("--base", action="store_true", help="use the base model, no adapter")
    p.add_argument("--tokens", required=True, help="comma-separated input token ids")
    p.add_argument("--max-new-tokens", type=int, default=8)

    p = command("unstage", cmd_unstage, "remove an adapter id from a node's store")
    p.add_argument("--id", required=True)

    p = command("rollout", cmd_rollout, "promote one adapter on many nodes at once (they share chunks as they arrive); prints each node's time")
    p.add_argument("nodes", nargs="*", metavar="NODE", help="more nodes (host:port)")
    p.add_argument("--id", required=True, help="adapter id")
    p.add_argument("--from", dest="peer", required=True, help="host:port of a seed that has the adapter")
    p.add_argument("--name", help="name requests will use (default: the id)")
    p.add_argument("--stage-only", action="store_true", help="pull into each node's store without loading a slot (store-only nodes)")
    p.add_argument("--no-swarm", action="store_true", help="every node pulls from the seed alone (a baseline)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each node may take")

    p = command("demo", cmd_demo, "start a local 3-node cluster on the tiny model and move adapters across it", node=False)
    p.add_argument("--workdir", help="where node stores and logs go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory afterwards")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except FabricError as exc:
        print(f"fabric {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
