"""`python -m shadowtrace_hooks doctor`: what the hooks find and hook in this environment;
`python -m shadowtrace_hooks bisect`: which layers' shadow value, grafted, restores the output."""

import sys

from shadowtrace_hooks import doctor


def main(argv: list[str]) -> int:
    if argv[:1] == ["bisect"]:
        from shadowtrace_hooks import bisect

        return bisect.main(argv[1:])
    if argv[:1] != ["doctor"] or len(argv) > 1:
        print(
            "usage: python -m shadowtrace_hooks doctor | bisect MODEL PROMPT --threshold X", file=sys.stderr
        )
        print(
            "  for each engine installed here: its version, the modules the adapters hook, whether "
            "each was found and hooked, and why not",
            file=sys.stderr,
        )
        return 2
    return doctor.run(sys.stdout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
