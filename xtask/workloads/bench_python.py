"""Benchmark: an allocation-heavy script for Debian's /usr/bin/python3, whose
interpreter is built without frame pointers, so its allocations come from deep C
stacks (the eval loop, object, list, dict and str code) that only a CFI unwinder
follows. Blocks above pymalloc's 512-byte limit go to malloc: long strings, lists
and dicts that grow, JSON text. Usage: python3 bench_python.py ROUNDS. Waits for a
line on stdin first, so a tracer can attach (everything is imported before)."""

import json
import sys


def make_records(count, salt):
    return [
        {"id": i, "name": "record-%05d-%s" % (i, "x" * (i % 700)), "tags": ["t%d" % (i % 7)] * (i % 90), "salt": salt}
        for i in range(count)
    ]


def index_by_tag(records):
    index = {}
    for record in records:
        for tag in record["tags"]:
            index.setdefault(tag, []).append(record["id"])
    return index


def churn(count):
    kept = []
    for i in range(count):
        text = "y" * (520 + i % 1500)  # a str object above pymalloc's limit
        row = [i] * (70 + i % 50)  # the item array of a list
        buf = bytearray(600 + i % 100)
        kept.append((text.upper(), row, buf))
        if len(kept) > 64:
            kept.pop(0)
    return len(kept)


def render(records, index):
    text = json.dumps({"records": records, "index": index}, sort_keys=True)
    decoded = json.loads(text)
    return len(text) + len(decoded["records"])


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    if not sys.stdin.readline():
        sys.exit(1)
    total = 0
    for salt in range(rounds):
        records = make_records(300, salt)
        total += render(records, index_by_tag(records)) + churn(2000)
    print(total)


if __name__ == "__main__":
    main()
