"""One rank of the share_object test: shares a fixed sequence of objects, prints what it got."""

import hashlib
import json
import sys

import mlx.core as mx

from node.rank.share import ShareError, share_object

BLOB = bytes(range(256)) * (5 * 1024 * 1024 // 256)  # 5 MiB


def main():
    group = mx.distributed.init(backend="ring", strict=True)
    rank = group.rank()

    def mine(value):
        return value if rank == 0 else None

    out = {"rank": rank, "size": group.size()}
    out["text"] = share_object(mine("hello"), group)
    out["unicode"] = share_object(mine("héllo wörld 世界 🎉"), group)
    got = share_object(
        mine({"name": "image.png", "data": BLOB, "parts": [b"a", b"", b"bc"]}), group
    )
    out["blob"] = [
        got["name"],
        len(got["data"]),
        hashlib.sha256(got["data"]).hexdigest(),
        [p.decode() for p in got["parts"]],
    ]
    out["none"] = share_object(None, group)
    try:
        share_object(mine(b"x" * 2_000_000), group, max_bytes=1_000_000)
        out["oversize"] = "no error"
    except ShareError as e:
        out["oversize"] = str(e)
    try:
        share_object(mine({"not json": {1, 2}}), group)
        out["unencodable"] = "no error"
    except ShareError as e:
        out["unencodable"] = str(e)
    out["after"] = share_object(mine({"still": "in step"}), group)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
