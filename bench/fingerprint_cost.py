"""What the costliest bodies a client may send cost the fingerprint, against hashing their bytes.

The fingerprint canonicalises JSON, form and multipart bodies on the event loop (up to 1 MiB;
larger ones in a worker thread, which holds the interpreter as long), so the worst body of each
kind is the longest stall one request can buy for every other. Each row is a body built to be
as dear as the limits allow (`oncegate.kernel.fingerprint`'s), and the CPU time of this process
per fingerprint: the minimum and the median of `--repeats` runs. The `bytes` column is the same
body fingerprinted as its bytes (SHA-256 alone). A row marked `bytes rule` is past a limit and
fingerprinted as its bytes.

    .venv/bin/python bench/fingerprint_cost.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from oncegate.kernel import fingerprint

JSON = "application/json"
FORM = fingerprint.FORM
BOUNDARY = "b0undary"
MULTIPART = f"{fingerprint.MULTIPART}; boundary={BOUNDARY}"
# A fraction no binary float holds exactly: the dearer path.
FRACTION = b"0.123456789012345678,"


def _fill(unit: bytes, limit: int, opening: bytes = b"", closing: bytes = b"") -> bytes:
    count = (limit - len(opening) - len(closing)) // len(unit)
    return opening + unit * count + closing


def _members(limit: int) -> bytes:
    """A JSON object of as many short members, each named once, as `limit` bytes hold."""
    members, size, n = [], 2, 0
    while size + len(member := b'"%x":1' % n) + 1 <= limit:
        members.append(member)
        size += len(member) + 1
        n += 1
    return b"{" + b",".join(members) + b"}"


def _multipart(heads: list[bytes]) -> bytes:
    delimiter = b"--" + BOUNDARY.encode()
    parts = b"".join(delimiter + b"\r\n" + head + b"\r\n\r\nv\r\n" for head in heads)
    return parts + delimiter + b"--\r\n"


def _parameters_head(size: int) -> bytes:
    """A part head of about `size` bytes, all of it short parameters."""
    head = b'Content-Disposition: form-data; name="a"'
    parameters = b"".join(b";p%d=v" % n for n in range(size // 8))
    return head + parameters[: size - len(head)].rpartition(b";")[0]


def bodies() -> list[tuple[str, str, bytes]]:
    json_limit, form_limit = fingerprint.CANONICAL_JSON_LIMIT, fingerprint.CANONICAL_FORM_LIMIT
    heads = fingerprint.MULTIPART_HEADS_LIMIT
    parts = fingerprint.MULTIPART_PART_LIMIT
    per_part = 8 * 1024  # under MULTIPART_HEAD_LIMIT, so only the heads' total limits them
    return [
        ("JSON, short members", JSON, _members(json_limit)),
        ("JSON, numbers with exponents", JSON, _fill(b"1e5,", json_limit, b"[", b"0]")),
        ("JSON, 18-digit fractions", JSON, _fill(FRACTION, json_limit, b"[", b"0]")),
        ("form, names alone", FORM, _fill(b"a&", form_limit, b"", b"a")),
        ("form, escaped names", FORM, _fill(b"%41&", form_limit, b"", b"a")),
        ("form, short fields", FORM, _fill(b"ab=1&", form_limit, b"", b"z=0")),
        ("multipart, 500 short parts", MULTIPART,
         _multipart([b'Content-Disposition: form-data; name="a"'] * parts)),
        ("multipart, heads at the limit, all parameters", MULTIPART,
         _multipart([_parameters_head(per_part)] * (heads // per_part))),
        ("multipart, 500 parts of 280 parameters (past the limit)", MULTIPART,
         _multipart([_parameters_head(1_900)] * 500)),
    ]  # fmt: skip


def canonicalised(content_type: str, body: bytes) -> bool:
    """Whether the fingerprint canonicalises `body`, or takes it as its bytes."""
    if content_type == JSON:
        limit, canonical = fingerprint.CANONICAL_JSON_LIMIT, fingerprint.canonical_json(body)
    elif content_type == FORM:
        limit, canonical = fingerprint.CANONICAL_FORM_LIMIT, fingerprint.canonical_form(body)
    else:
        limit, canonical = len(body), fingerprint.canonical_multipart(content_type, body)
    return len(body) <= limit and canonical is not None


def cpu_per_call(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        started = time.process_time()
        call()
        times.append(time.process_time() - started)
    return min(times) * 1000, statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    arguments = parser.parse_args()
    print(f"$ .venv/bin/python bench/fingerprint_cost.py --repeats {arguments.repeats}\n")
    print("| body | size | rule | CPU ms, min (median) | its bytes alone, ms |")
    print("|---|---:|---|---:|---:|")
    for name, content_type, body in bodies():

        def canonical(content_type: str = content_type, body: bytes = body) -> object:
            return fingerprint.of_request("POST", "/x", "", content_type, body)

        def raw(body: bytes = body) -> object:
            return fingerprint.of_request("POST", "/x", "", "application/octet-stream", body).digest

        rule = "canonical" if canonicalised(content_type, body) else "bytes rule"
        least, median = cpu_per_call(canonical, arguments.repeats)
        raw_least, _ = cpu_per_call(raw, arguments.repeats)
        shown = f"{least:.1f} ({median:.1f})"
        print(f"| {name} | {len(body):,} | {rule} | {shown} | {raw_least:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
