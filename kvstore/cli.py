"""`kvstore`: the admin CLI for manual checks and scripts.

    kvstore put    --servers H:P[,H:P] --text "some prompt" [--class agent]
    kvstore lookup --servers ... --text "some prompt"
    kvstore get    --servers ... --text "some prompt" [--layers 0:2] [--out DIR]
    kvstore stats  --servers ... [--json] [--grep hits]
    kvstore fsck   DATA_DIR [--rebuild]
    kvstore tenant SALT                                   # the digest tokens are scoped to
    kvstore token new --name N --tenants HEX,... --verbs read,write [--append tokens.toml]
    kvstore analytics replay TRACE.jsonl [--capacity 1%,10%] [--plot PNG] [--json PATH]

Prompts are given as token ids (--tokens 1,2,3 or --tokens-file) or as --text, whose UTF-8 bytes
stand in for token ids. The namespace flags (--model, --num-layers, ...) must match between put and
get, as they would between engines. Exit codes: 0 done, 1 the operation failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvstore.block import KVLayout, Namespace, tenant_of
from kvstore.client.config import add_security_flags, security_settings


def _namespace_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", required=True, help="comma-separated host:port of the daemons, or a "
                        "dns:///NAME:PORT, dns+srv:///NAME or etcd://HOST:PORT/PREFIX target")
    parser.add_argument("--model", default="kvstore-cli", help="model identity (part of the namespace)")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--codec", default="raw", help="how the blocks are stored: raw, zstd, int8 or int4")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--salt", default="", help="tenant cache salt (never stored)")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--tokens", help="comma-separated token ids")
    group.add_argument("--tokens-file", type=Path, help="file of whitespace-separated token ids")
    group.add_argument("--text", help="text whose UTF-8 bytes are used as token ids")
    parser.add_argument("--timeout", type=float, default=5.0, help="deadline of each call, seconds")
    add_security_flags(parser)


def _blocks(args: argparse.Namespace):
    namespace = Namespace(args.model, KVLayout(args.num_layers, args.kv_heads, args.head_dim, args.dtype,
                                               codec=args.codec), args.block_tokens, args.salt)
    if args.text is not None:
        tokens = list(args.text.encode())
    else:
        raw = args.tokens_file.read_text() if args.tokens_file else args.tokens.replace(",", " ")
        try:
            tokens = [int(t) for t in raw.split()]
        except ValueError:
            raise ValueError("token ids must be integers") from None
    blocks = namespace.blocks(tokens)
    if not blocks:
        raise ValueError(f"{len(tokens)} tokens make no full block of {args.block_tokens}; give more tokens")
    return namespace, blocks


def _client(args: argparse.Namespace):
    from kvstore.client import ClientConfig, KVClient
    return KVClient(ClientConfig(tuple(s for s in args.servers.split(",") if s), timeout_s=args.timeout,
                                 lookup_timeout_s=args.timeout, **security_settings(args)))


REFUSED_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED")  # the daemon answered, and said no to this caller


def _why(address: str, error: str) -> str:
    """A daemon's failed call in words: refused (a token missing, bad or without the right) or not answered."""
    if error.split(":", 1)[0] in REFUSED_CODES:
        return f"daemon {address} refused the call: {error} (check --token or KVSTORE_TOKEN)"
    return f"daemon {address} did not answer: {error}"


def _report(command: str, errors: dict[str, str]) -> bool:
    """Say on stderr why each daemon in `errors` failed a call; whether any did. Every command that asks daemons
    reports so: an engine rightly takes a failed daemon as a miss, an operator wants to know why."""
    for address, error in errors.items():
        print(f"kvstore {command}: {_why(address, error)}", file=sys.stderr)
    return bool(errors)


def cmd_put(args: argparse.Namespace) -> int:
    namespace, blocks = _blocks(args)
    if args.payload_file:
        data = args.payload_file.read_bytes()
        if len(data) != namespace.block_bytes * len(blocks):
            raise ValueError(f"--payload-file has {len(data)} bytes; {len(blocks)} blocks of this layout need "
                             f"{namespace.block_bytes * len(blocks)}")
        payloads = [data[i * namespace.block_bytes : (i + 1) * namespace.block_bytes] for i in range(len(blocks))]
    else:
        payloads = [os.urandom(namespace.block_bytes) for _ in blocks]
    with _client(args) as client:
        summary = client.put(list(zip(blocks, payloads)), namespace.num_layers, args.traffic_class)
        errors = client.last_errors()
    print(f"{len(blocks)} blocks of {namespace.block_bytes} bytes: stored {summary.stored}, "
          f"already present {summary.existed}, failed {summary.failed}")
    if args.verbose:
        for block in blocks:
            print(block.key.hex())
    failed = _report("put", errors)
    return 1 if summary.failed or failed else 0


def cmd_lookup(args: argparse.Namespace) -> int:
    namespace, blocks = _blocks(args)
    with _client(args) as client:
        hits = client.lookup(blocks)
        errors = client.last_errors()
    if _report("lookup", errors):
        print(f"at least {hits} of {len(blocks)} leading blocks cached; the daemons above could not be asked")
        return 1
    print(f"{hits} of {len(blocks)} leading blocks cached ({hits * namespace.block_tokens} tokens)")
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    namespace, blocks = _blocks(args)
    begin, _, end = args.layers.partition(":")
    layer_begin, layer_end = int(begin or 0), int(end) if end else None
    with _client(args) as client:
        got = client.get(blocks, layer_begin, layer_end)
        causes = dict(client.stats.miss_causes)
        errors = client.last_errors()
    if _report("get", errors):
        print(f"at least {len(got)} of {len(blocks)} leading blocks cached; the daemons above could not be read")
        return 1
    print(f"{len(got)} of {len(blocks)} leading blocks read and verified"
          + (f"; misses: {causes}" if causes else ""))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for data in got:
            (args.out / f"{data.block.key.hex()}.kv").write_bytes(data.kv())
        print(f"payloads written to {args.out}/<key>.kv (decoded: the engine's KV)")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from kvstore.client import ClientConfig, KVClient
    config = ClientConfig(tuple(s for s in args.servers.split(",") if s), lookup_timeout_s=args.timeout,
                          **security_settings(args))
    with KVClient(config) as c:
        stats = c.server_stats()
        errors = {address: error for address, error in c.last_errors().items() if stats.get(address) is None}
    _report("stats", errors)
    if args.json:  # {address: [{"name", "labels", "value"}, ...] or null}
        print(json.dumps({a: s.to_json() if s is not None else None for a, s in stats.items()}, indent=2,
                         sort_keys=True))
    else:
        for address, samples in stats.items():
            refused = errors.get(address, "").split(":", 1)[0] in REFUSED_CODES
            print(f"== {address}" + ("" if samples is not None else "  (refused the call)" if refused
                                     else "  (unreachable)"))
            for name, value in sorted((s.text(), s.value) for s in samples or ()):
                if args.grep in name:
                    print(f"  {name:60s} {value:>16,.0f}" if value == int(value) else f"  {name:60s} {value:>16.4f}")
    return 1 if any(v is None for v in stats.values()) else 0


def cmd_fsck(args: argparse.Namespace) -> int:
    from kvstore.server.frames import FrameKeyDamaged, FrameKeyMissing
    from kvstore.server.fsck import DataDirBusy, check, in_use, rebuild
    from kvstore.server.index import IndexUnavailable
    if not ((args.data_dir / "index").is_dir() or (args.data_dir / "segments").is_dir()):
        raise ValueError(f"{args.data_dir} is not a kvstore data directory (no index/ or segments/ inside)")
    if args.rebuild:
        import logging
        logging.basicConfig(level=logging.INFO, format="kvstore fsck: %(message)s")  # progress, on stderr
        try:
            result = rebuild(args.data_dir)
        except (DataDirBusy, IndexUnavailable, FrameKeyMissing, FrameKeyDamaged) as exc:
            print(f"kvstore fsck: {exc}", file=sys.stderr)
            return 1
        if result.set_aside is not None:
            print(f"the damaged index was moved aside to {result.set_aside} (delete it once you no longer need it)")
        print(f"index rebuilt: {result.stats}; {result.dropped} entries that did not match their record dropped")
    if not args.rebuild and in_use(args.data_dir):  # --rebuild refuses it; a check can go on, if told what it means
        print(f"kvstore fsck: warning: a kvstore-server is using {args.data_dir}: it writes while this reads, so a "
              "problem below may be a record it is writing; stop it for a check that holds", file=sys.stderr)
    report = check(args.data_dir, verify_payloads=not args.no_payload)
    print(f"{report.entries} index entries, {report.verified} verified, {len(report.problems)} problems; "
          f"{report.segments} segments ({report.open_segments} left open), "
          f"{report.segment_bytes:,} segment bytes, {report.live_bytes:,} live; "
          f"{report.unindexed} records not in the index")
    for problem in report.problems[:50]:
        print("  " + problem)
    return 0 if report.ok else 1


def cmd_tenant(args: argparse.Namespace) -> int:
    salt = sys.stdin.read().rstrip("\n") if args.salt == "-" else args.salt
    print(tenant_of(salt).hex())
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    """Print a new token on the first line (give it to the engine); the entry goes to the daemons' file."""
    from kvstore.server.auth import VERBS, new_token, token_entry
    verbs = [v for v in args.verbs.split(",") if v]
    if not verbs or any(v not in VERBS for v in verbs):
        raise ValueError(f"--verbs must list some of {', '.join(VERBS)}")
    tenants = None if args.tenants == "*" else [_tenant_digest(t) for t in args.tenants.split(",") if t]
    if tenants == []:
        raise ValueError("--tenants must list tenant digests (kvstore tenant SALT) or be '*'")
    token = new_token()
    entry = token_entry(args.name, token, tenants, verbs)
    print(token)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + entry)
        print(f"entry {args.name!r} appended to {args.append}; restart the daemons to accept it", file=sys.stderr)
    else:
        print(entry, end="")
    return 0


def _tenant_digest(text: str) -> bytes:
    try:
        digest = bytes.fromhex(text)
    except ValueError:
        digest = b""
    if len(digest) != 16:
        raise ValueError(f"{text!r} is not a tenant digest (32 hex digits; kvstore tenant SALT prints one)")
    return digest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Admin CLI of the kvstore KV-cache store.")
    sub = parser.add_subparsers(dest="command", required=True)
    put = sub.add_parser("put", help="store the full blocks of a prompt (random or given payloads)")
    _namespace_args(put)
    put.add_argument("--class", dest="traffic_class", default="chat", help="traffic class (sets the TTL)")
    put.add_argument("--payload-file", type=Path, help="layer-major payloads of all blocks, concatenated")
    put.add_argument("--verbose", action="store_true", help="also print every block's key (hex), one a line")
    put.set_defaults(run=cmd_put)
    lookup = sub.add_parser("lookup", help="how many leading blocks of a prompt are cached")
    _namespace_args(lookup)
    lookup.set_defaults(run=cmd_lookup)
    get = sub.add_parser("get", help="read and verify the cached blocks of a prompt")
    _namespace_args(get)
    get.add_argument("--layers", default="0:", help="layer range begin:end (default all)")
    get.add_argument("--out", type=Path, help="write each block's payload to OUT/<key>.kv")
    get.set_defaults(run=cmd_get)
    stats = sub.add_parser("stats", help="each daemon's counters and gauges")
    stats.add_argument("--servers", required=True)
    stats.add_argument("--json", action="store_true")
    stats.add_argument("--grep", default="", help="only names containing this")
    stats.add_argument("--timeout", type=float, default=5.0)
    add_security_flags(stats)
    stats.set_defaults(run=cmd_stats)
    fsck = sub.add_parser("fsck", help="check a stopped daemon's data directory (a running one's: with a warning)")
    fsck.add_argument("data_dir", type=Path)
    fsck.add_argument("--no-payload", action="store_true", help="check headers only (faster)")
    fsck.add_argument("--rebuild", action="store_true",
                      help="first make the index know every verifiable record in the segments (a lost or damaged "
                           "index; a damaged one is moved aside)")
    fsck.set_defaults(run=cmd_fsck)
    tenant = sub.add_parser("tenant", help="the tenant digest of a cache salt, to scope tokens to")
    tenant.add_argument("salt", help="the tenant's cache salt; '-' reads it from standard input")
    tenant.set_defaults(run=cmd_tenant)
    token = sub.add_parser("token", help="make a token and the token-file entry that accepts it")
    token.add_argument("action", choices=["new"])
    token.add_argument("--name", required=True, help="shown in the daemon's log instead of the token")
    token.add_argument("--tenants", required=True, help="comma-separated tenant digests (kvstore tenant), or '*'")
    token.add_argument("--verbs", required=True, help="comma-separated: read, write, delete, admin")
    token.add_argument("--append", type=Path, help="append the entry to this token file (else print it)")
    token.set_defaults(run=cmd_token)
    from kvstore.analytics.cli import add_parser as add_analytics
    add_analytics(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a missing file, a directory, no permission: name it, no traceback
        name = f"{exc.filename}: " if exc.filename else ""
        print(f"kvstore {args.command}: cannot read {name}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvstore {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
