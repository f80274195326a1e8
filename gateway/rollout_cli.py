"""`carousel rollout status|pause|resume|abort|promote --url URL`: a rollout, from a shell.

A thin client of the gateway's `/admin/rollout` routes: prints the status (or the error) as
JSON and exits non-zero on an error.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import httpx

ACTIONS = ("status", "pause", "resume", "abort", "promote")


def add_rollout(sub: Any) -> None:
    p = sub.add_parser("rollout", help="watch or steer a progressive rollout (docs/rollout.md)")
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--model", default=None, help="the deployment (default: the only rollout)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("CAROUSEL_ADMIN_API_KEY"),
        help="an admin API key (default: $CAROUSEL_ADMIN_API_KEY)",
    )
    p.set_defaults(func=rollout)


def rollout(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    params = {"model": args.model} if args.model else {}
    base = args.url.rstrip("/") + "/admin/rollout"
    url = base if args.action == "status" else f"{base}/{args.action}"
    try:
        method = "GET" if args.action == "status" else "POST"
        response = httpx.request(method, url, params=params, headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        print(json.dumps({"error": {"message": f"cannot reach {args.url}: {exc}"}}))
        return 1
    print(json.dumps(response.json(), indent=2))
    return 0 if response.is_success else 1
