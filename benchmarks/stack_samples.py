"""Where a program's main thread spent its wall-clock time: counts of faulthandler stack samples.

Reads a file written by ``faulthandler.dump_traceback_later(..., repeat=True)`` (all threads) and
prints, for the thread whose outermost frame is in ``--main`` (a file name), the share of samples
per innermost frame of this package, and per innermost frame overall.

Usage: python benchmarks/stack_samples.py trace.txt --main gpu_fit.py
"""

from __future__ import annotations

import argparse
import collections
import re

FRAME = re.compile(r'\s+File "(.+)", line (\d+) in (\S+)')


def samples(text: str, main: str) -> list[list[str]]:
    """Each sample's main-thread frames, innermost first."""
    out, frames = [], []
    for line in text.splitlines() + ["Thread"]:
        if line.startswith(("Thread", "Current thread")):
            if frames and main in frames[-1]:
                out.append(frames)
            frames = []
        elif m := FRAME.match(line):
            frames.append(f"{m[1].split('site-packages/')[-1].split('/src/')[-1]}:{m[2]} {m[3]}")
    return out


def main() -> None:
    """Print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--main", default="gpu_fit.py")
    parser.add_argument("--package", default="nereus_lightning/")
    args = parser.parse_args()
    got = samples(open(args.trace).read(), args.main)
    print(f"{len(got)} samples of the main thread")
    for title, pick in (
        ("innermost frame of the package", lambda f: next((x for x in f if args.package in x), "-")),
        ("innermost frame", lambda f: f[0]),
        ("outermost package frame chain", lambda f: " < ".join(x for x in f if args.package in x)[:300]),
    ):
        print(f"\n{title}:")
        for key, n in collections.Counter(pick(f) for f in got).most_common(15):
            print(f"{n / len(got):6.1%}  {key}")


if __name__ == "__main__":
    main()
