"""`python -m shadowtrace_hooks`: the hooks' own command line, `doctor` and `bisect`.

The parser imports neither torch nor an engine: `--help` answers at once; each command imports
what it runs."""

import argparse
import sys
from pathlib import Path

from shadowtrace_hooks.config import GRAFT_SITES


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m shadowtrace_hooks",
        description="The shadowtrace hooks' commands, run in the engine's Python environment.",
    )
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    doctor = commands.add_parser(
        "doctor",
        help="whether tracing is set up here, and what the hooks hook in each engine installed",
        description=(
            "Whether tracing is set up in this environment: the startup .pth installed (an "
            "editable install leaves it out, and SHADOWTRACE=1 then starts nothing), the "
            "SHADOWTRACE_* variables (a bad value, a name that is no variable), SHADOWTRACE_DIR "
            "writable. Then whether the hooks' Triton kernels run here, and for each engine "
            "installed here its version, every module the adapters hook, whether it was found "
            "and hooked, and why not. Exit status 0 when every check passed and every engine "
            "installed was hooked, else 1."
        ),
    )
    doctor.add_argument("--json", action="store_true", help="one JSON object instead of text")
    bisect = commands.add_parser(
        "bisect",
        help="which layers' shadow value, grafted into production, restores a transformers model's output",
        description=(
            "Which layers' local fp32 shadow value, grafted into production at one site, restores "
            "a transformers model's output (glm_moe_dsa, deepseek_v32; FP8 checkpoints as they "
            "load). Judged against the model's own fp32 chain. With nothing planted there is no "
            "clean floor here: the target is --threshold. Exit status 0 when the bisection ran, "
            "2 on bad input."
        ),
    )
    bisect.add_argument("model", type=Path, help="model directory (transformers' from_pretrained)")
    bisect.add_argument(
        "prompt",
        type=Path,
        help="prompt file: a JSON list of token ids, or text for the model's tokenizer",
    )
    bisect.add_argument(
        "--threshold",
        type=float,
        required=True,
        help="restored at this argmax agreement or more (argmax), or this JS divergence or less (js)",
    )
    bisect.add_argument("--metric", choices=["argmax", "js"], default="argmax", help="what restored measures")
    sites = ", ".join(GRAFT_SITES)
    bisect.add_argument(
        "--sites", default=",".join(GRAFT_SITES), help=f"sites searched, comma-separated, among {sites}"
    )
    bisect.add_argument(
        "--rows",
        default="all",
        help="the token rows whose logits are compared: all, or last:N for the last N (as "
        "`shadowtrace bisect --rows`; every:N is not implemented here)",
    )
    # The old spelling of --rows last:N: still read, with a warning.
    bisect.add_argument("--last", type=int, help=argparse.SUPPRESS)
    return top


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.command == "doctor":
        from shadowtrace_hooks import doctor

        return doctor.run(sys.stdout, as_json=args.json)
    from shadowtrace_hooks import bisect

    return bisect.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
