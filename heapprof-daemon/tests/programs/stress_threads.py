"""A multi-threaded python3 heapprofd joins and leaves (tests/inject_stress.rs).

THREADS threads build lists, dicts and bytes and check what they built; the main
thread prints "progress ROUNDS ERRORS" ten times a second (ROUNDS: rounds of all
threads so far, ERRORS: results found wrong) until its standard input closes.
"""

import sys
import threading
import time

rounds = [0]
errors = [0]
lock = threading.Lock()


def work(seed):
    n = seed
    while True:
        n = (n * 1103515245 + 12345) % (1 << 31)
        size = 50 + n % 400
        items = [bytes([i % 251]) * (i % 64 + 1) for i in range(size)]
        table = {i: items[i] for i in range(size)}
        joined = b"".join(table[i] for i in range(size))
        text = {str(i): [i] * 3 for i in range(size)}
        wrong = len(joined) != sum(i % 64 + 1 for i in range(size)) or sum(
            v[2] for v in text.values()
        ) != size * (size - 1) // 2
        with lock:
            rounds[0] += 1
            if wrong:
                errors[0] += 1


def main():
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    for i in range(count):
        threading.Thread(target=work, args=(i + 1,), daemon=True).start()
    done = threading.Event()

    def wait_for_eof():
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    print("ready", flush=True)
    while not done.wait(0.1):
        with lock:
            line = f"progress {rounds[0]} {errors[0]}"
        print(line, flush=True)


main()
