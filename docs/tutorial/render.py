"""Write the printed blocks of docs/tutorial.md from the committed demo run in docs/tutorial/demo_run/.

    python docs/tutorial/render.py          # rewrite the blocks in docs/tutorial.md from the committed run
    python docs/tutorial/render.py --check  # exit 1, naming the block, when docs/tutorial.md differs from the run

Each printed block of the tutorial follows a marker line ``<!-- demo_run/NAME.txt: ... -->`` and is that file's text
(the demo's absolute output folder shown as a clone's). tests/test_tutorial.py checks that the blocks are the run, that
the run's printed lines and its demo.json agree, and that the run's settings (demo.json's ``config``) are the demo's
current defaults, so a changed default fails until the run is recorded again:

1. in an empty folder: ``OMP_NUM_THREADS=1 /usr/bin/time hf-flatbias demo > demo.txt``, then
   ``hf-flatbias select flatbias-demo/sam > select.txt`` and
   ``hf-flatbias compare flatbias-demo/adamw flatbias-demo/sam --sort trace > compare.txt``;
2. copy the three files and flatbias-demo/demo.json to docs/tutorial/demo_run/, flatbias-demo/demo.png to
   docs/plots/demo.png, and update docs/tutorial/demo_run/run.json (date, folder, times, load, versions);
3. run this script, then reread the tutorial's prose around the blocks: the test names any decimal it quotes that
   the run does not hold.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN = HERE / "demo_run"
TUTORIAL = HERE.parent / "tutorial.md"
SHOWN_FOLDER = "/home/you/hf_flatbias/flatbias-demo"  # where a reader's clone would write, for the first line
COMMANDS = {  # the command each block's file was printed by, shown above its output (the demo's own block has none)
    "select": "hf-flatbias select flatbias-demo/sam",
    "compare": "hf-flatbias compare flatbias-demo/adamw flatbias-demo/sam --sort trace",
}
MARKER = re.compile(r"^<!-- demo_run/(?P<name>\w+)\.txt: [^\n]*-->\n```text\n(?P<body>.*?)^```$", re.M | re.S)


def run_record() -> dict:
    """docs/tutorial/demo_run/run.json: when, where and how long the committed run ran."""
    return json.loads((RUN / "run.json").read_text())


def block(name: str) -> str:
    """The text of one printed block, as the tutorial shows it."""
    printed = (RUN / f"{name}.txt").read_text()
    printed = printed.replace(run_record()["folder"], SHOWN_FOLDER)
    return f"$ {COMMANDS[name]}\n{printed}" if name in COMMANDS else printed


def render(tutorial: str) -> str:
    """``tutorial`` with every marked block replaced by the committed run's text."""
    names = [match["name"] for match in MARKER.finditer(tutorial)]
    missing = sorted({path.stem for path in RUN.glob("*.txt")} - set(names))
    if missing:
        raise ValueError(f"docs/tutorial.md has no marked block for demo_run/{missing[0]}.txt")

    def replace(match: re.Match) -> str:
        start, end = (index - match.start() for index in match.span("body"))
        return match[0][:start] + block(match["name"]) + match[0][end:]

    return MARKER.sub(replace, tutorial)


def stale_blocks(tutorial: str) -> list[str]:
    """The names of the marked blocks whose text is not the committed run's."""
    return [match["name"] for match in MARKER.finditer(tutorial) if match["body"] != block(match["name"])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether docs/tutorial.md is up to date")
    args = parser.parse_args(argv)
    text = TUTORIAL.read_text()
    if args.check:
        stale = stale_blocks(text)
        for name in stale:
            print(f"docs/tutorial.md: the block of demo_run/{name}.txt differs; run python docs/tutorial/render.py")
        return 1 if stale else 0
    rendered = render(text)
    if rendered != text:
        TUTORIAL.write_text(rendered)
        print(f"rewrote {TUTORIAL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
