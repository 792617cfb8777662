"""The loss curve of a training record as an SVG (no plotting library needed): next-byte
loss in bits per byte over the dense and sparse stages, and the indexer's KL loss over the
warm-up and sparse stages, against the step counted across stages.

    python models/train/plot.py models/glm5-tiny    # writes models/glm5-tiny/loss.svg
"""

import argparse
import json
import math
from pathlib import Path

W, H, PAD = 720, 220, 48
COLORS = {"dense": "#1f77b4", "warmup": "#2ca02c", "sparse": "#d62728"}


def panel(
    points: list[tuple[float, float, str]], top: float, title: str, ymax: float, xmax: float
) -> list[str]:
    def xy(x: float, y: float) -> tuple[float, float]:
        return PAD + x / xmax * (W - 2 * PAD), top + H - PAD - min(y, ymax) / ymax * (H - 2 * PAD)

    out = [
        f'<text x="{PAD}" y="{top + 20}" font-size="13">{title}</text>',
        f'<line x1="{PAD}" y1="{top + H - PAD}" x2="{W - PAD}" y2="{top + H - PAD}" stroke="#444"/>',
        f'<line x1="{PAD}" y1="{top + PAD}" x2="{PAD}" y2="{top + H - PAD}" stroke="#444"/>',
        f'<text x="{PAD - 6}" y="{top + PAD + 4}" font-size="10" text-anchor="end">{ymax:.2f}</text>',
        f'<text x="{PAD - 6}" y="{top + H - PAD + 4}" font-size="10" text-anchor="end">0</text>',
        f'<text x="{W - PAD}" y="{top + H - PAD + 14}" font-size="10" text-anchor="end">'
        f"step {int(xmax)}</text>",
    ]
    for stage, color in COLORS.items():
        pts = [xy(x, y) for x, y, s in points if s == stage]
        if pts:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{path}"/>')
    return out


def svg(record: dict) -> str:
    offset, lm, kl = {}, [], []
    base = 0
    for stage in ("dense", "warmup", "sparse"):
        offset[stage] = base
        base += record["steps"][stage]
    for row in record["curve"]:
        x = offset[row["stage"]] + row["step"]
        if "lm" in row:
            lm.append((x, row["lm"] / math.log(2), row["stage"]))
        if "kl" in row:
            kl.append((x, row["kl"], row["stage"]))
    bpb = record["heldout"]["bits_per_byte"]
    legend = " ".join(
        f'<tspan fill="{c}">{s} ({record["steps"][s]} steps)</tspan>' for s, c in COLORS.items()
    )
    body = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{2 * H + 30}" '
        'font-family="sans-serif">',
        f'<text x="{PAD}" y="16" font-size="13">{record["architecture"]}, seed {record["seed"]}: {legend}; '
        f"held-out {bpb:.3f} bits/byte</text>",
        *panel(lm, 24, "training loss, bits per byte (batch mean)", 8.0, base),
        *panel(
            kl, 24 + H, "indexer KL to the main attention (nats, mean over queries and layers)", 4.0, base
        ),
        "</svg>",
    ]
    return "\n".join(body) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folders", nargs="+", type=Path, help="model folders holding training_record.json")
    for folder in parser.parse_args().folders:
        record = json.loads((folder / "training_record.json").read_text())
        (folder / "loss.svg").write_text(svg(record))
        print(f"plot: wrote {folder / 'loss.svg'}")


if __name__ == "__main__":
    main()
