"""The tool-call task (issue 40): prompts whose answer needs keys thousands of tokens back.

The only source of both the training data and the evaluation prompts. Byte-level (vocab 256,
as the models). One example, `length` bytes in all:

    \\x01 schema \\n schema ... \\x02 filler \\x03 call <description> \\x04 {"name":...} \\x05

- 3 to 16 compact JSON function schemas, `{"description":D,"name":N,"arguments":{P:V,...},
  "parameters":{P:{"enum":[...]},...}}` (`arguments`: each parameter's default, one of its
  enum), names, descriptions, parameters and values made of random syllables, so nothing can
  be memorised. The call is the schema's own bytes from `"name"` to the end of `arguments`,
  right after the description, and the request ends with the description: the lookup is
  "find the description, copy what follows", which an induction (copying) circuit does. The
  bytes from the description's end to the name are as many in the schema (`","name":"`) as
  in the request and answer (`\\x04{"name":"`), so the same relative offset finds both.
  (Version 1 had the defaults inside `parameters`, after the name: the arguments were no
  copy of any schema span, and the first trained models learnt none of the task.)
  Where the schemas would take more than half the length, the last ones are dropped (never
  below 3). Lengths from `MIN_LENGTH` up always fit; a shorter one may raise.
- filler: a window of the corpus (`corpus.py`), from its train split for training seeds and
  its held-out split for held-out seeds, up to the target length.
- the request: `\\x03call ` and one schema's description, then `\\x04`.
- the answer, `\\x04` exclusive to `\\x05` inclusive: `{"name":N,"arguments":{P:V,...}}`,
  compact, the schema's name and arguments. Name and values are copied from the schemas;
  nothing else decides them.

The no-tool control (`tools=False`) draws the same schemas and the same corpus window but
writes no schema: its filler starts earlier in the corpus to keep the length, so with one
request its last bytes, right before the request, are the tool example's filler. Its request is `\\x03say `
and random words, its answer `{"reply":<the same words>}\\x05`: a request that needs no
tool and no key further back than the request.

Training examples may carry several requests (`requests=n`): the filler is cut in n pieces,
each followed by a request and its answer, for n distinct tools. Evaluation prompts carry one.

The delimiters 0x01-0x05 never occur in the corpus (it is Python source; `example` raises
if a filler window holds one). Seeds below `HELDOUT_SEED_BASE` are training's, the rest
held out (`example` asserts the split matches the seed).

    python models/train/toolcall.py --corpus DIR --seed 1000000000 --length 2048 [--no-tools]
    python models/train/toolcall.py --corpus DIR --write-demo tracer/demo/toolcall
"""

import argparse
import hashlib
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

VERSION = 2
TOOLS_BEGIN, TOOLS_END, REQUEST, ANSWER, END = b"\x01", b"\x02", b"\x03", b"\x04", b"\x05"
DELIMITERS = TOOLS_BEGIN + TOOLS_END + REQUEST + ANSWER + END
HELDOUT_SEED_BASE = 1_000_000_000
MIN_TOOLS, MAX_TOOLS = 3, 16
# Filler bytes each request needs before it at least.
MIN_FILLER = 64
MIN_LENGTH = 1024
# The shortest segment a copy row writes twice.
COPY_MIN = 12
CONSONANTS = "bcdfghjklmnprstvwz"
VOWELS = "aeiou"


def source_hash() -> str:
    """This file's sha256: the training record names the generator that made its data."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def split_of(seed: int) -> str:
    if seed < 0:
        raise ValueError(f"toolcall: seed {seed} is negative")
    return "train" if seed < HELDOUT_SEED_BASE else "heldout"


def compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode()


def word(rng: random.Random, syllables: tuple[int, int]) -> str:
    n = rng.randint(*syllables)
    return "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(n))


def schema(rng: random.Random) -> dict:
    name = "_".join(word(rng, (1, 3)) for _ in range(rng.randint(2, 3)))
    description = " ".join(word(rng, (1, 3)) for _ in range(rng.randint(3, 5)))
    params, defaults, n_params = {}, {}, rng.randint(1, 3)
    while len(params) < n_params:
        values, n_values = [], rng.randint(2, 4)
        while len(values) < n_values:
            value = word(rng, (1, 3))
            if value not in values:
                values.append(value)
        param = word(rng, (2, 3))
        defaults[param] = rng.choice(values)
        params[param] = {"enum": values}
    return {"description": description, "name": name, "arguments": defaults, "parameters": params}


def call_of(tool: dict) -> dict:
    """The expected call: the tool's name and its default arguments, in schema order."""
    return {"name": tool["name"], "arguments": dict(tool["arguments"])}


@dataclass
class Example:
    seed: int
    length: int
    tools: bool
    ids: bytes
    # [start, end) of each answer (its JSON and the END byte) in `ids`.
    answers: list[tuple[int, int]]
    # [start, end) of the schema block, TOOLS_BEGIN to TOOLS_END inclusive; (0, 0) without tools.
    schema_span: tuple[int, int]
    expected: list[dict]
    schemas: list[dict] = field(default_factory=list)

    @property
    def prompt(self) -> bytes:
        """The bytes up to the first answer: what a model is given."""
        return self.ids[: self.answers[0][0]]


def example(seed: int, length: int, text: dict[str, bytes], tools: bool = True, requests: int = 1) -> Example:
    """The example of `seed`, exactly `length` bytes; `text` maps "train"/"heldout" to the
    corpus splits (only the seed's split is read)."""
    rng = random.Random(seed)
    split = text[split_of(seed)]
    drawn, n_tools = [], rng.randint(MIN_TOOLS, MAX_TOOLS)
    while len(drawn) < n_tools:
        tool = schema(rng)
        if all(tool["name"] != t["name"] and tool["description"] != t["description"] for t in drawn):
            drawn.append(tool)
    # Drop trailing schemas until they fit in half the length.
    keep = len(drawn)
    while keep > MIN_TOOLS and len(block(drawn[:keep])) > length // 2:
        keep -= 1
    schemas = drawn[:keep]
    picks = rng.sample(range(keep), min(requests, keep))
    chats = [" ".join(word(rng, (1, 3)) for _ in range(rng.randint(3, 5))) for _ in picks]
    cut_draws = [rng.random() for _ in range(len(picks) - 1)]
    start_draw = rng.random()

    # Both kinds of turn are made whichever is asked for, so that the tool example and its
    # control share the filler window.
    tool_turns = [(call_of(schemas[p]), b"call " + schemas[p]["description"].encode()) for p in picks]
    chat_turns = [({"reply": chat}, b"say " + chat.encode()) for chat in chats]

    def size(turns) -> int:
        return sum(len(REQUEST + request + ANSWER + compact(call) + END) for call, request in turns)

    head = block(schemas)
    # Where the length leaves too little filler, the last requests are dropped (never the first).
    while True:
        filler_len = length - len(head) - size(tool_turns)
        if filler_len >= len(tool_turns) * MIN_FILLER or len(tool_turns) == 1:
            break
        tool_turns.pop()
        chat_turns.pop()
    if filler_len < MIN_FILLER:
        raise ValueError(f"toolcall: length {length} leaves {filler_len} filler bytes (seed {seed})")
    cut_draws = cut_draws[: len(tool_turns) - 1]
    # The control's filler is the tool example's window extended back to the same length.
    most_back = len(head) + size(tool_turns)
    start = most_back + int(start_draw * (len(split) - most_back - filler_len))
    if tools:
        turns, window = tool_turns, split[start : start + filler_len]
    else:
        back = length - filler_len - size(chat_turns)
        assert 0 <= back <= most_back, (back, most_back)
        turns, window, head = chat_turns, split[start - back : start + filler_len], b""
    if any(d in window for d in DELIMITERS):
        raise ValueError(f"toolcall: the corpus window of seed {seed} holds a delimiter byte")
    cuts = sorted(int(d * len(window)) for d in cut_draws)
    pieces = [window[a:b] for a, b in zip([0, *cuts], [*cuts, len(window)], strict=True)]

    ids, answers = bytearray(head), []
    for piece, (call, request) in zip(pieces, turns, strict=True):
        ids += piece + REQUEST + request + ANSWER
        answer = compact(call)
        answers.append((len(ids), len(ids) + len(answer) + len(END)))
        ids += answer + END
    assert len(ids) == length, (len(ids), length)
    return Example(
        seed=seed,
        length=length,
        tools=tools,
        ids=bytes(ids),
        answers=answers,
        schema_span=(0, len(head)),
        expected=[call for call, _ in turns],
        schemas=schemas if tools else [],
    )


def copy_row(rng: random.Random, length: int, window: bytes) -> tuple[bytes, list[tuple[int, int]]]:
    """A curriculum row of `length` bytes for the copy stage: 1 to 3 random segments, each
    written twice, in corpus text (`window`, at least `length` bytes of it). A segment is
    either random words or a call's compact JSON (`{"name":...,"arguments":{...}}` of a
    random schema), `COPY_MIN` to `length // 8` bytes. Returns the row and the [start, end) of each
    second copy but its first byte (the bytes only a copy predicts).

    The task's answer is a copy of a span thousands of bytes back, which the models learn
    only once they can copy at all; in corpus text and in the task's sparse answers that
    circuit does not form within the training the GPU machine allows (models/README.md), in
    rows this dense in copies it does."""
    n = rng.randint(1, 3)
    segments = []
    for _ in range(n):
        if rng.random() < 0.5:
            seg = compact(call_of(schema(rng)))
        else:
            seg = " ".join(word(rng, (1, 3)) for _ in range(rng.randint(2, 12))).encode()
            while len(seg) < COPY_MIN:
                seg += b" " + word(rng, (1, 3)).encode()
        segments.append(seg[: max(COPY_MIN, length // 8)])
    order = [*range(n), *rng.sample(range(n), n)]
    text_len = length - sum(len(segments[i]) for i in order)
    cuts = sorted(rng.randint(0, text_len) for _ in range(len(order)))
    gaps = [b - a for a, b in zip([0, *cuts], [*cuts, text_len], strict=True)]
    row, copies, pos = bytearray(), [], 0
    for i, (gap, seg) in enumerate(zip(gaps, order, strict=False)):
        row += window[pos : pos + gap]
        pos += gap
        if i >= n:
            copies.append((len(row) + 1, len(row) + len(segments[seg])))
        row += segments[seg]
    row += window[pos : pos + gaps[-1]]
    assert len(row) == length, (len(row), length)
    return bytes(row), copies


def block(schemas: list[dict]) -> bytes:
    return TOOLS_BEGIN + b"\n".join(compact(s) for s in schemas) + TOOLS_END


def load_text(corpus: Path) -> dict[str, bytes]:
    return {name: (corpus / f"{name}.bin").read_bytes() for name in ("train", "heldout")}


# The demo's prompts (tracer/demo/toolcall/): held out, apart from toolcall_eval's seeds.
DEMO_SEED = HELDOUT_SEED_BASE + 900_000_000
DEMO_LENGTHS = (1024, 3072, 6144)
DEMO_PER_LENGTH = 2


def demo_sets(text: dict[str, bytes]) -> dict[str, dict]:
    """File name -> content of the demo's prompt sets: per length, tool and no-tool prompts
    of the same seeds. `ids` is the prompt (up to and including the ANSWER byte); `answer`
    the expected answer's text, which the END byte (5) follows; the two make `length` bytes."""
    sets = {}
    for length in DEMO_LENGTHS:
        for tools in (True, False):
            prompts = []
            for i in range(DEMO_PER_LENGTH):
                ex = example(DEMO_SEED + length + i, length, text, tools)
                start, end = ex.answers[0]
                prompts.append(
                    {
                        "seed": ex.seed,
                        "schema_span": list(ex.schema_span),
                        "answer": ex.ids[start : end - len(END)].decode("ascii"),
                        "ids": list(ex.prompt),
                    }
                )
            name = f"{'tool' if tools else 'notool'}_{length}.json"
            sets[name] = {"generator_version": VERSION, "length": length, "tools": tools, "prompts": prompts}
    return sets


def write_demo_sets(folder: Path, text: dict[str, bytes]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in demo_sets(text).items():
        path = folder / name
        path.write_text(json.dumps(content, separators=(",", ":")) + "\n")
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", type=Path, required=True, help="folder written by corpus.py")
    parser.add_argument("--seed", type=int, default=HELDOUT_SEED_BASE)
    parser.add_argument("--length", type=int, default=MIN_LENGTH)
    parser.add_argument("--no-tools", action="store_true", help="the no-tool control")
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--write-demo", type=Path, help="write the demo's prompt sets to this folder")
    args = parser.parse_args()
    if args.write_demo:
        for path in write_demo_sets(args.write_demo, load_text(args.corpus)):
            print(f"toolcall: wrote {path}")
        return
    ex = example(args.seed, args.length, load_text(args.corpus), not args.no_tools, args.requests)
    shown = {
        "seed": ex.seed,
        "split": split_of(ex.seed),
        "length": ex.length,
        "tools": ex.tools,
        "schema_span": ex.schema_span,
        "answers": ex.answers,
        "expected": ex.expected,
        "head": ex.ids[:400].decode("latin-1"),
        "tail": ex.ids[-200:].decode("latin-1"),
    }
    json.dump(shown, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
