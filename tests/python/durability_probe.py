"""How long after a forward returns its rows are readable on disk: the traced tiny GLM-5 of
test_reliability.py (600 tokens, 9,606 rows a forward) runs forwards back to back, and is
killed (SIGKILL) a chosen delay after it printed that its first forward returned. Prints, per
delay, in how many trials the first forward's run was complete with every row in part files.

usage: durability_probe.py [--delays-ms 0,50,100,...] [--trials N]

(test_reliability.py's durability test keeps the bound this measures as an assertion.)
"""

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from test_reliability import killed_after_return

    parser = argparse.ArgumentParser()
    parser.add_argument("--delays-ms", default="0,25,50,100,200,400,800")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    for delay in [int(d) for d in args.delays_ms.split(",")]:
        whole = 0
        for _ in range(args.trials):
            with tempfile.TemporaryDirectory() as tmp:
                started = time.monotonic()
                whole += killed_after_return(Path(tmp), delay / 1000, signal.SIGKILL)
                took = time.monotonic() - started
        print(f"kill {delay:>5} ms after the return: {whole}/{args.trials} runs whole ({took:.1f} s a trial)",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
