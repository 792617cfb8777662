"""The training corpus: the Python standard library's own source, as installed.

Nobody here wrote it, it ships with every Python, and it has the long-range structure the
DSA indexer exists for: a name imported or defined near the top of a module is used
thousands of bytes later. Byte-level: a token is a byte (vocab 256), files joined by a 0
byte, which never occurs in Python source.

Which files: every `*.py` under the interpreter's stdlib, in sorted path order, but the test
suites (`test/`, `tests/`, `idle_test/`) and `site-packages/` (third-party code). Held out:
the files whose path hashes below `HELD_OUT_SHARE`, so held-out text is whole files the
models never trained on. `corpus.json` records the interpreter, every file with its size and
hash, and the hash of each split, so a corpus rebuilt elsewhere can be checked byte for byte.

    python models/train/corpus.py --out DIR       # writes train.bin, heldout.bin, corpus.json
"""

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
from pathlib import Path

SEPARATOR = b"\x00"
SKIPPED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
# One file in 32 (by path hash) is held out.
HELD_OUT_SHARE = 1 / 32


def sources(stdlib: Path) -> list[Path]:
    """The stdlib's own `*.py` files, sorted by path relative to `stdlib`."""
    found = [
        p
        for p in stdlib.rglob("*.py")
        if not SKIPPED_DIRS.intersection(p.relative_to(stdlib).parts[:-1]) and p.is_file()
    ]
    return sorted(found, key=lambda p: p.relative_to(stdlib).as_posix())


def held_out(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "big") < HELD_OUT_SHARE * 2**32


def build(out: Path, stdlib: Path) -> dict:
    """Write `train.bin`, `heldout.bin` and `corpus.json` under `out`; return the record."""
    out.mkdir(parents=True, exist_ok=True)
    files, splits = [], {"train": bytearray(), "heldout": bytearray()}
    for path in sources(stdlib):
        rel = path.relative_to(stdlib).as_posix()
        data = path.read_bytes()
        if SEPARATOR in data:  # not text; a 0 byte would read as a file boundary
            continue
        split = "heldout" if held_out(rel) else "train"
        splits[split] += data + SEPARATOR
        files.append(
            {"path": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16], "split": split}
        )
    record = {
        "source": "the Python standard library's *.py files as installed, "
        "test suites and site-packages excluded",
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "stdlib": str(stdlib),
        "tokenizer": "bytes (vocab 256); files joined by a 0 byte",
        "held_out": f"files whose sha256(path) falls in the lowest {HELD_OUT_SHARE:.4f} of the hash range",
        "splits": {},
        "files": files,
    }
    for name, data in splits.items():
        (out / f"{name}.bin").write_bytes(bytes(data))
        record["splits"][name] = {
            "bytes": len(data),
            "files": sum(f["split"] == name for f in files),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    (out / "corpus.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for train.bin, heldout.bin, corpus.json"
    )
    parser.add_argument(
        "--stdlib",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="stdlib folder (this Python's)",
    )
    args = parser.parse_args()
    if not args.stdlib.is_dir():
        sys.exit(f"corpus: no stdlib folder at {args.stdlib}")
    record = build(args.out, args.stdlib)
    for name, split in record["splits"].items():
        print(
            f"corpus: {name}: {split['files']} files, {split['bytes']} bytes, sha256 {split['sha256'][:16]}"
        )


if __name__ == "__main__":
    main()
