"""B4's scripted "office" day, run inside the Debian guest (python3 only: the image has no compiler and
no network). Every few seconds it edits documents, rebuilds a small Python project (byte-compiling it, the
guest's "compile"), and browses pages of a local web server (``python3 -m http.server``), keeping a disk
cache of the pages and an in-memory cache like a browser's. It runs until killed.

    python3 office_workload.py [ROOT]        # default /root/office
"""

import compileall
import hashlib
import os
import random
import subprocess
import sys
import time
import urllib.request

WORDS = ["report", "budget", "meeting", "quarter", "figures", "draft", "review", "customer", "invoice",
         "schedule", "project", "minutes", "agenda", "proposal", "summary", "deadline", "contract", "travel",
         "expense", "forecast", "memo"]


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_site(root, rng):
    site = os.path.join(root, "site")
    os.makedirs(site, exist_ok=True)
    for i in range(300):
        links = " ".join(f'<a href="p{rng.randrange(300)}.html">next</a>' for _ in range(5))
        body = "".join(f"<p>{text(rng, 120)}</p>" for _ in range(rng.randrange(5, 40)))
        with open(os.path.join(site, f"p{i}.html"), "w") as f:
            f.write(f"<html><head><title>page {i}</title></head><body>{body}{links}</body></html>")
    return site


def edit(root, rng, step):
    docs = os.path.join(root, "docs")
    os.makedirs(docs, exist_ok=True)
    path = os.path.join(docs, f"doc{rng.randrange(25)}.txt")
    with open(path, "a") as f:
        f.write(f"\n[{step}] {text(rng, rng.randrange(50, 400))}\n")
    with open(os.path.join(docs, "sheet.csv"), "w") as f:   # a spreadsheet saved whole each time
        for _row in range(2000):
            f.write(",".join(str(rng.randrange(10000)) for _ in range(8)) + "\n")


def build(root, rng, step):
    proj = os.path.join(root, "proj")
    os.makedirs(proj, exist_ok=True)
    n = rng.randrange(40)
    with open(os.path.join(proj, f"mod{n}.py"), "w") as f:
        f.write(f"# edited at step {step}\n")
        for k in range(rng.randrange(50, 300)):
            f.write(f"def f{k}(x):\n    return x * {rng.randrange(1000)} + {k}  # {text(rng, 6)}\n")
    compileall.compile_dir(proj, quiet=1)


def browse(root, rng, memory_cache):
    cache = os.path.join(root, "browser-cache")
    os.makedirs(cache, exist_ok=True)
    for _ in range(rng.randrange(3, 10)):
        url = f"http://127.0.0.1:8000/p{rng.randrange(300)}.html?v={rng.randrange(1 << 30)}"
        page = urllib.request.urlopen(url, timeout=10).read()
        rendered = page * 16 + os.urandom(64 * 1024)      # decoded images and layout of the page
        key = hashlib.sha256(url.encode()).hexdigest()
        with open(os.path.join(cache, key), "wb") as f:
            f.write(rendered[: len(page) * 4])
        memory_cache.append(rendered)
        while sum(len(x) for x in memory_cache) > 48 << 20:   # the browser's memory cache, oldest out
            memory_cache.pop(0)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "/root/office"
    rng = random.Random(42)
    site = make_site(root, rng)
    server = subprocess.Popen([sys.executable, "-m", "http.server", "8000", "--bind", "127.0.0.1",
                               "--directory", site], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)
    memory_cache: list[bytes] = []
    step = 0
    try:
        while True:
            step += 1
            edit(root, rng, step)
            build(root, rng, step)
            browse(root, rng, memory_cache)
            with open(os.path.join(root, "steps"), "w") as f:
                f.write(f"{step}\n")
            time.sleep(4)
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
