"""A small, deterministic Python workload for the true-stacks tests (tests/true_stacks.rs).

Run by Debian's /usr/bin/python3, whose interpreter is built without frame pointers:
its allocations come from deep C stacks (the eval loop, object and dict code), which
only a CFI unwinder follows back to main. Kept small: valgrind (DHAT) runs it too, and
the interpreter is slow under valgrind.
"""

import json


def make_records(count):
    return [
        {"id": i, "name": "record-%05d" % i, "tags": ["t%d" % (i % 7), "u%d" % (i % 5)], "score": i * 0.5}
        for i in range(count)
    ]


def index_by_tag(records):
    index = {}
    for record in records:
        for tag in record["tags"]:
            index.setdefault(tag, []).append(record["id"])
    return index


def render(records, index):
    parts = []
    for tag in sorted(index):
        parts.append("%s=%s" % (tag, ",".join(str(i) for i in index[tag][:20])))
    text = json.dumps({"records": records, "index": index}, sort_keys=True)
    decoded = json.loads(text)
    return "\n".join(parts), len(text), len(decoded["records"])


def main():
    records = make_records(1500)
    index = index_by_tag(records)
    summary, length, count = render(records, index)
    print(len(summary), length, count)


if __name__ == "__main__":
    main()
