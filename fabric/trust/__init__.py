"""Signed adapters: Ed25519 signatures over an adapter's manifest digest, and the keys a node trusts."""
