"""A model loader stand-in: maps a .gguf file, then allocates anonymous memory for real.

Anonymous, touched memory (not page cache) is what a GPU load on unified
memory costs. Usage:
    fake_loader.py [-m FILE.gguf] [--read] --alloc MiB [--rate MiB/s] [--ignore-term]
--read reads the whole model file first, as a load streams its weights from disk: the
file's pages land in the page cache, which on unified memory the GPU cannot have.
"""

import argparse
import mmap
import signal
import time

ap = argparse.ArgumentParser()
ap.add_argument("-m", "--model")
ap.add_argument("--alloc", type=int, default=100)
ap.add_argument("--rate", type=int, default=0, help="MiB/s; 0 = all at once")
ap.add_argument("--ignore-term", action="store_true", help="a loader that will not stop")
ap.add_argument("--read", action="store_true", help="read the model file through first")
args, _ = ap.parse_known_args()  # stands in for llama-server: its other flags are ignored
if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

keep = []
if args.model and args.read:
    with open(args.model, "rb") as f:
        while f.read(4 * 1024 * 1024):
            pass
if args.model:
    try:
        with open(args.model, "rb") as f:
            keep.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
    except (OSError, ValueError) as e:  # a server that cannot read its model says so, stays up
        print(f"fake loader: {args.model!r}: {e}", flush=True)
step = args.rate if args.rate else args.alloc
done = 0
while done < args.alloc:
    chunk = min(step, args.alloc - done)
    keep.append(bytearray(b"\x01") * (chunk * 1024 * 1024))  # written: every page touched
    done += chunk
    if args.rate:
        time.sleep(1)
print(f"fake loader holding {done} MiB", flush=True)
while True:
    time.sleep(3600)
