"""`meshd api-key create NAME | list | revoke NAME-OR-ID`: keys for the HTTP APIs.

The commands edit `<state_dir>/api_keys.json` directly (no daemon needed); a running daemon
sees the change on its next request. `register(subparsers)` adds them to the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `api-key` with its three subcommands; `args.handler(args)` runs the chosen one."""
    from meshd.config import add_setting_flags

    common = argparse.ArgumentParser(add_help=False)
    add_setting_flags(common, ("state_dir",))
    parser = subparsers.add_parser("api-key", help="keys for the HTTP APIs on non-loopback hosts")
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser(
        "create", parents=[common], help="make a key (printed once; only its hash is kept)"
    )
    create.add_argument("name", help="what uses the key, e.g. open-webui or laptop")
    listing = actions.add_parser("list", parents=[common], help="the keys (names, ids, created)")
    listing.add_argument("--json", action="store_true")
    revoke = actions.add_parser(
        "revoke", parents=[common], help="delete a key: it stops working at once"
    )
    revoke.add_argument("key", help="the key's name or id")
    parser.set_defaults(handler=run)


def _store(args: argparse.Namespace):
    from meshd.config import load_config
    from meshd.http.keys import ApiKeyStore

    config = load_config({"state_dir": args.state_dir} if args.state_dir else {})
    return ApiKeyStore(config.state_dir)


def run(args: argparse.Namespace) -> int:
    from meshd.http.keys import ApiKeyError

    store = _store(args)
    try:
        if args.action == "create":
            entry, secret = store.create(args.name)
            print(secret)
            print(
                f"created API key {entry.name!r} (id {entry.key_id}); it is shown only now. "
                "Clients send it as `Authorization: Bearer KEY` or `x-api-key: KEY`.",
                file=sys.stderr,
            )
        elif args.action == "list":
            keys = store.keys()
            if args.json:
                print(json.dumps([_public(asdict(k)) for k in keys], indent=2))
            elif not keys:
                print("no API keys (create one with `meshd api-key create NAME`)")
            for key in keys if not args.json else ():
                created = time.strftime("%Y-%m-%d %H:%M", time.localtime(key.created_at))
                print(f"{key.key_id}  {key.name:24}  {key.shown}...  created {created}")
        else:
            entry = store.revoke(args.key)
            print(f"revoked API key {entry.name!r} (id {entry.key_id})")
    except ApiKeyError as exc:
        print(f"meshd: {exc}", file=sys.stderr)
        return 2
    return 0


def _public(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "sha256"}
