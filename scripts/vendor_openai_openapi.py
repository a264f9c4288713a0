"""Refresh the vendored subset of OpenAI's OpenAPI document (tests/contract/openai-openapi.json).

    python scripts/vendor_openai_openapi.py PATH_OR_URL [--commit SHA]

PATH_OR_URL is ``openapi.json`` of https://github.com/openai/openai-openapi (a local checkout's
file, or the raw URL of one commit). The subset keeps the operations Inferplane serves under
/v1 (OPERATIONS below) and every component they reference, transitively; nothing is edited,
so a refresh is a plain diff. The tests validate answers against it (tests/contract).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "tests" / "contract" / "openai-openapi.json"

# Each path of the public API that /v1 serves, today or as the batch and moderation legs land.
OPERATIONS = {
    "/models": ["get"],
    "/models/{model}": ["get"],
    "/chat/completions": ["post"],
    "/completions": ["post"],
    "/files": ["get", "post"],
    "/files/{file_id}": ["get", "delete"],
    "/files/{file_id}/content": ["get"],
    "/batches": ["get", "post"],
    "/batches/{batch_id}": ["get"],
    "/batches/{batch_id}/cancel": ["post"],
    "/moderations": ["post"],
    "/embeddings": ["post"],
    "/responses": ["post"],
    "/responses/{response_id}": ["get", "delete"],
    "/responses/{response_id}/input_items": ["get"],
}
# Not reached from any operation's declared response, but every error body has this shape.
EXTRA = ["ErrorResponse"]


def _refs(node: Any, found: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            found.add(ref.rsplit("/", 1)[1])
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


def subset(document: dict[str, Any]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for path, methods in OPERATIONS.items():
        paths[path] = {}
        for method in methods:
            operation = document["paths"][path][method]
            # Responses only: requests are validated by the gateway's own schema.
            paths[path][method] = {
                "operationId": operation.get("operationId"),
                "responses": operation["responses"],
            }
    schemas = document["components"]["schemas"]
    wanted: set[str] = set(EXTRA)
    _refs(paths, wanted)
    done: set[str] = set()
    while wanted - done:
        name = (wanted - done).pop()
        done.add(name)
        _refs(schemas[name], wanted)
    return {
        "openapi": document["openapi"],
        "info": {"title": document["info"]["title"], "version": document["info"]["version"]},
        "paths": paths,
        "components": {"schemas": {name: schemas[name] for name in sorted(done)}},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="openapi.json: a path or a URL")
    parser.add_argument("--commit", default="", help="the openai/openai-openapi commit it is from")
    args = parser.parse_args()
    if args.source.startswith(("http://", "https://")):
        with urllib.request.urlopen(args.source, timeout=60) as response:  # noqa: S310
            document = json.load(response)
    else:
        document = json.loads(Path(args.source).read_text())
    result = subset(document)
    result["info"]["x-vendored-from"] = {
        "repository": "https://github.com/openai/openai-openapi",
        "file": "openapi.json",
        "commit": args.commit,
        "date": dt.datetime.now(dt.UTC).date().isoformat(),
    }
    OUT.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    print(f"wrote {OUT} ({len(result['components']['schemas'])} components)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
