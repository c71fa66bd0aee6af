"""Commands on a node's store: stage, pull, unstage, keep, ls, inspect, locate."""

from __future__ import annotations

import argparse
import json
from typing import Any

from adapter_fabric.cli.connect import client_for, peer_address
from adapter_fabric.cli.output import emit, pull_note
from adapter_fabric.cli.progress import PullWatcher, byte_bar, on_terminal, run_polled
from adapter_fabric.cli.sign import private_key_file, read_signature_file


def cmd_stage(args: argparse.Namespace) -> None:
    show = on_terminal(args.json)
    with client_for(args, timeout=args.timeout) as client, byte_bar(f"stage {args.id}", 0, show) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        def resumed(offset: int, total: int) -> None:
            if show:
                bar.write(f"resuming the upload of {args.id}: the node holds {offset} of {total} bytes")

        sign_key = private_key_file(args.sign_key, "--sign-key") if args.sign_key else None
        signature = read_signature_file(args.signature) if args.signature else None
        reply = run_polled(lambda: client.stage(args.dir, args.id, progress=progress, on_resume=resumed, sign_key=sign_key, signature=signature), None)
    notes = [n for n, on in (("its bytes were here already: nothing new stored", reply.already_staged), (f"resumed at byte {reply.resumed_from}", reply.resumed_from)) if on]
    note = f" ({', '.join(notes)})" if notes else ""
    emit(args.json, reply.to_dict(), f"staged {reply.adapter_id} digest={reply.digest} content_id={reply.content_id:#018x}{note}")


def cmd_pull(args: argparse.Namespace) -> None:
    show = on_terminal(args.json)
    if not args.peer:  # the node finds it: held, its known peers, then its origins (no peer to watch the progress of)
        with client_for(args, timeout=args.timeout) as client:
            reply = run_polled(lambda: client.pull(args.id), None)
    else:
        with client_for(args, timeout=args.timeout) as client, client_for(args, args.peer) as source:
            watcher = PullWatcher(client, source, args.id, f"pull {args.id}", show)
            reply = run_polled(lambda: client.pull(args.id, peer=args.peer, named_peer_only=args.no_swarm), watcher.poll)
            watcher.finish(f"from {reply.source_peer or 'local store'}")
    emit(args.json, {"adapter_id": args.id, **reply.to_dict()}, f"{args.id} digest={reply.digest}{origin_note(reply)}: {pull_note(reply)}")


def origin_note(reply) -> str:
    """`` origin=URI revision=REV`` for an id from an origin; "" otherwise."""
    return f" origin={reply.origin} revision={reply.revision}" if reply.origin else ""


def cmd_keep(args: argparse.Namespace) -> None:
    with client_for(args) as client:
        kept = client.keep(args.id, not args.unkeep)
    emit(args.json, {"adapter_id": args.id, "kept": kept}, f"{'kept' if kept else 'no longer kept'}: {args.id}")


def cmd_unstage(args: argparse.Namespace) -> None:
    with client_for(args) as client:
        removed = client.unstage(args.id)
    emit(args.json, {"adapter_id": args.id, "bytes_removed": removed}, f"unstaged {args.id}" + ("" if removed else " (bytes kept: another id refers to them)"))


def cmd_ls(args: argparse.Namespace) -> None:
    with client_for(args) as client:
        listing = client.list(args.page_size)  # every page
    # "B stored" is every file (config and weights); a pull's or promote's "B of weights" counts the weights file only
    lines = [f"staged ({len(listing.staged)}):"]
    for a in listing.staged:
        damage = f"  DAMAGED: {a.damaged}" if a.damaged else ""
        engines = f"  engines: {','.join(a.engines)}" if a.engines else ""
        origin = f"  origin: {a.origin} @ {a.revision[:40]}" if a.origin else ""
        lines.append(f"  {a.adapter_id:<32} {a.digest[:16]}  {a.size:>10} B stored  r={a.peft.r} alpha={a.peft.lora_alpha:g}{engines}{origin}{damage}")
    if listing.slots:
        lines.append(f"slots (device {listing.device}, max rank {listing.max_rank}; * active, P pinned):")
        for s in listing.slots:
            if s.empty:
                lines.append(f"  [{s.slot}] (empty)")
                continue
            flags = "".join(f for f, on in (("*", s.active), ("P", s.pinned)) if on)
            lines.append(f"  [{s.slot}] {s.name or '-':<24} id={s.content_id:#018x} refs={s.ref_count} rank={s.rank} last_use={s.last_used} {flags}")
    else:
        lines.append("no slots (a store-only node)")
    emit(args.json, listing.to_dict(), "\n".join(lines))


def cmd_inspect(args: argparse.Namespace) -> None:
    from adapter_fabric.store.manifest import Manifest
    from adapter_fabric.trust.signing import signatures_from_proto

    with client_for(args) as client:
        reply = client.manifest_proto(args.id, with_sha256=args.sha256)
    m = Manifest.from_proto(reply)
    files: list[dict[str, Any]] = [{"name": f.name, "size": f.size, "root": f.root, "chunk_size": f.chunk_size, "chunks": f.chunk_count} for f in m.files]
    for f in files if args.sha256 else ():
        f["sha256"] = reply.file_sha256.get(f["name"], "")
    tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in m.tensors]
    payload = {
        "adapter_id": m.adapter_id,
        "digest": m.digest,
        "content_id": m.content_id,
        "files": files,
        "config": json.loads(m.config_json),
        "modules": list(m.modules),
        "tensors": tensors,
        # each signer's raw Ed25519 public key in hex, as fabric keygen and fabric sign print it ("" for one not recorded)
        "signers": [signed.signer for signed in signatures_from_proto(reply)],
        "origin": reply.origin,
        "revision": reply.revision,
    }
    lines = [f"{m.adapter_id}  digest={m.digest}  content_id={m.content_id:#018x}"]
    lines += [f"  from origin {reply.origin}  revision={reply.revision}"] if reply.origin else []
    lines += [f"  {f['name']:<28} {f['size']:>11} B  root={f['root'][:16]}…  {f['chunks']} chunk(s) of {f['chunk_size']} B" for f in files]
    lines += [f"  {f['name']:<28} sha256={f['sha256']}" for f in files if "sha256" in f]
    c = m.config
    lines.append(f"  r={c.r} lora_alpha={c.lora_alpha:g} use_rslora={c.use_rslora} base_model={payload['config'].get('base_model_name_or_path')}")
    lines.append(f"  {len(tensors)} tensors over {len(m.modules)} modules: {', '.join(m.modules[:6])}{' …' if len(m.modules) > 6 else ''}")
    signers = [signer or "(a signer this node did not record)" for signer in payload["signers"]]
    lines.append(f"  signed by {len(signers)}: {', '.join(signers)}" if signers else "  unsigned (fabric stage --sign-key KEY, or --signature FILE, signs it)")
    emit(args.json, payload, "\n".join(lines))


def cmd_locate(args: argparse.Namespace) -> None:
    with client_for(args) as client:
        found = client.locate(args.id)
    lines = [f"{args.id} digest={found.digest}: held by {len(found.peers)} known peer(s)"]
    lines += [f"  {p.address:<24} {'complete' if p.complete else f'{p.verified_chunks} chunks verified'}" for p in found.peers]
    emit(args.json, {"adapter_id": args.id, **found.to_dict()}, "\n".join(lines))


def register(command) -> None:
    """Add this module's subcommands through ``command(name, handler, help)`` (see ``adapter_fabric.cli.main``)."""
    p = command("stage", cmd_stage, "upload a PEFT adapter directory to a node (resumes an interrupted upload)", long=True)
    p.add_argument("dir", help="directory with adapter_config.json and adapter_model.safetensors")
    p.add_argument("--id", required=True, help="adapter id, e.g. team-a/support-v3")
    signing = p.add_mutually_exclusive_group()
    signing.add_argument("--sign-key", help="sign the adapter's digest with this Ed25519 private key (fabric keygen); the signature travels with it")
    signing.add_argument("--signature", help="attach a signature made elsewhere: the file fabric sign DIR --key KEY --out FILE wrote")

    p = command("pull", cmd_pull, "make a node pull an adapter into its store from a peer (and the swarm), loading no slot", long=True)
    p.add_argument("--from", dest="peer", type=peer_address,
                   help="host:port of a peer that has the adapter (omit: the node looks itself: held, the id's homes (with --homes 0: its known peers), then its --origin list)")
    p.add_argument("--id", required=True, help="adapter id (ID@REVISION pins an origin's revision)")
    p.add_argument("--no-swarm", action="store_true", help="pull from --from alone, not from every peer that holds chunks")

    p = command("unstage", cmd_unstage, "remove an adapter id from a node's store (its export directory entry goes too)")
    p.add_argument("--id", required=True, help="adapter id")

    p = command("keep", cmd_keep, "keep an adapter on a node: its evicting store never drops it (--unkeep: may be evicted again)")
    p.add_argument("--id", required=True, help="adapter id")
    p.add_argument("--unkeep", action="store_true", help="stop keeping it")

    p = command("ls", cmd_ls, "list a node's staged adapters (every page) and slots")
    p.add_argument("--page-size", type=int, default=0, help="adapters asked for per call (0 = the node's default, 1000; at most 5000)")

    p = command("inspect", cmd_inspect, "show an adapter's manifest on a node: files, digests, config, tensors")
    p.add_argument("--id", required=True, help="adapter id")
    p.add_argument("--sha256", action="store_true", help="also each file's sha256, to compare with a model hub's listing (the node reads the files once)")

    p = command("locate", cmd_locate, "which of a node's peers hold an adapter, fully or in part")
    p.add_argument("--id", required=True, help="adapter id")
