"""share_object on real ranks over the ring backend on loopback."""

import json

from node.rank.share import decode, encode


def test_wire_format_is_json_header_plus_raw_bytes():
    data = encode({"k": [1, "é"], "img": b"\x00\xff" * 3})
    n = int.from_bytes(data[:4], "little")
    header = json.loads(data[4 : 4 + n])
    assert header == {"k": [1, "é"], "img": {"$blob": [0, 6]}}
    assert data[4 + n :] == b"\x00\xff" * 3
    assert decode(data) == {"k": [1, "é"], "img": b"\x00\xff" * 3}
