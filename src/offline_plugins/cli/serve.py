"""``offline-plugins serve reward DIR`` / ``serve judge SPEC``: a reward model or a judge over HTTP
(:mod:`offline_plugins.eval.serve`; the training side: ``--reward http://HOST:PORT``)."""

from __future__ import annotations

import argparse
import sys

from offline_plugins.errors import UserError
from offline_plugins.text.sources.remote import TOKEN_ENV, TOKEN_FILE_ENV, read_token


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def cmd_serve(args) -> int:
    try:
        import aiohttp  # noqa: F401  (imported to say what is missing before loading the model)
    except ImportError:
        raise UserError("serving needs aiohttp: pip install 'offline-plugins[serve]'") from None
    token = read_token(file=args.token_file, what="serve")
    if len(token) < 16:
        raise UserError(f"the token is {len(token)} characters; use at least 16 random ones (e.g. python -c "
                        f"'import secrets; print(secrets.token_urlsafe(32))' > FILE, then --token-file FILE or "
                        f"${TOKEN_FILE_ENV}; or ${TOKEN_ENV})")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"offline-plugins: warning: serving on {args.host}, reachable from other machines: the bearer token is "
              "the only protection (put TLS in front of it)", file=sys.stderr)
    from offline_plugins.eval.serve import serve

    serve(args.kind, args.target, token=token, host=args.host, port=args.port, max_batch=args.max_batch,
          max_bytes=int(args.max_request_mb * (1 << 20)), timeout=args.timeout,
          print_fn=lambda line: print(line, flush=True))
    return 0


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a reward model (train reward-model / prm output) or a judge over HTTP, with a bearer token",
        description="The token is read from --token-file, $OFFLINE_PLUGINS_TOKEN_FILE or $OFFLINE_PLUGINS_TOKEN, "
        "never from the command line. A run scores with it by --reward http://HOST:PORT (or --judge http://...), "
        "the same token in its environment.")
    p.add_argument("kind", choices=("reward", "judge"), help="what to serve")
    p.add_argument("target", help="reward: a train reward-model or prm output folder; judge: what --judge takes "
                   "(a registered judge, a model folder, MODULE:FUNCTION)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--token-file", metavar="FILE", help="file holding the bearer token")
    p.add_argument("--max-batch", type=int, default=256, help="items a request may hold (default 256)")
    p.add_argument("--max-request-mb", type=_positive, default=4.0, help="largest request body in MiB (default 4)")
    p.add_argument("--timeout", type=_positive, default=60.0, help="seconds scoring one request may take (default 60)")
    p.set_defaults(func=cmd_serve)
