"""``fabric store-status NODE``: what a node's store holds beyond its adapters (self-contained; the CLI registers it)."""

from __future__ import annotations

import argparse


def _more(count: int, what: str, hint: str) -> list[str]:
    """The line saying how many of a bounded list the reply left out (none when it left out nothing)."""
    return [f"  ... and {count} more {what} ({hint})"] if count > 0 else []


def cmd_store_status(args: argparse.Namespace) -> None:
    from adapter_fabric.cli.connect import client_for
    from adapter_fabric.cli.output import emit

    with client_for(args) as client:
        reply = client.store_status()
    from adapter_fabric.units import describe_size as _size
    from adapter_fabric.units import format_duration

    # sizes in one unit everywhere (QuotaExceeded says them alike); durations as the flags write them (24h)
    used = f"{_size(reply.used_bytes)} used of {_size(reply.quota_bytes)}" if reply.quota_bytes else f"{_size(reply.used_bytes)} used, no limit but the disk"
    expiry = f"after {format_duration(reply.expire_after_seconds)} untouched" if reply.expire_after_seconds else "never"
    lines = [f"{args.node}: {reply.adapters} adapter{'' if reply.adapters == 1 else 's'}, {used}; abandoned entries expire {expiry}"]
    if not reply.quota_bytes:
        at_limit = "without --max-store-bytes nothing is evicted"
    elif reply.evicts:
        at_limit = f"at the limit: evicts cold adapters, least recently used first ({reply.evictions} evicted since start)"
    else:
        at_limit = "at the limit: refuses commits (a durable node: never evicts)"
    lines.append(f"  {at_limit}; {reply.kept} kept by an operator")
    for evicted in reply.recent_evictions:
        ids = ",".join(evicted.adapter_ids) or "?"
        lines.append(f"  evicted  {ids:30} {_size(evicted.bytes):>10}  {format_duration(round(evicted.age_seconds))} ago  {evicted.digest[:16]}  (for {evicted.reason})")
    lines.extend(_more(reply.evictions - len(reply.recent_evictions), "evictions", "the latest are shown; fabric_store_evictions_total counts them"))
    for tenant in reply.tenants:
        limit_bytes = _size(tenant.max_bytes) if tenant.max_bytes else "no byte limit"
        limit_ids = f"{tenant.max_adapters} adapters" if tenant.max_adapters else "no id limit"
        lines.append(f"  tenant   {tenant.prefix:30} {_size(tenant.bytes)} of {limit_bytes}, {tenant.adapters} of {limit_ids}")
    for kind, items, total in (("upload", reply.uploads, reply.uploads_total), ("partial", reply.partials, reply.partials_total)):
        for item in items:
            state = "in use" if item.in_use else f"idle {item.age_seconds:.0f}s"
            lines.append(f"  {kind:8} {item.adapter_id or '?':30} {_size(item.bytes):>10}  {state}  {item.digest[:16]}")
        lines.extend(_more(total - len(items), f"{kind}s", "the oldest are shown"))
    for origin in reply.origins:
        state = "answering" if origin.answering else f"NOT ANSWERING: held ids it gave are served as held; a miss there is refused ({origin.error})"
        lines.append(f"  origin   {origin.origin:30} {state}")
    for entry in reply.damaged:
        lines.append(f"  damaged  {entry.adapter_id or '?':30} {entry.digest[:16] or '-':16}  {entry.reason}")
    lines.extend(_more(reply.damaged_total - len(reply.damaged), "damaged entries", "fabric ls pages through every one"))
    emit(args.json, reply.to_dict(), "\n".join(lines))


def register(command) -> None:
    """Add ``store-status`` through ``command(name, handler, help)`` (see ``adapter_fabric.cli.main``)."""
    command("store-status", cmd_store_status, "a node's store: usage, quota, kept uploads and partial downloads (age, bytes), damaged entries")
