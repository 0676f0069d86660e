"""Screenshot of `spekula tui` after a code-rewrite request on SmolLM2: docs/tui.svg (+ docs/tui.png).

    .venv/bin/python bench/tui_screenshot.py [--n-predict 120] [--out docs/tui.svg]

Runs the real app headless (Textual's run_test) with an embedded engine, types the request, waits
for the answer and the statistics poll after it, and saves the screen. The PNG is written when
`cairosvg` is importable (it is not a spekula dependency).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio

from spekula.frontends.cli.main import build_parser
from spekula.frontends.cli.options import build_engine, sampling_from_args
from spekula.frontends.schema.completion import ServerDefaults
from spekula.frontends.tui.app import EmbeddedSource, SpekulaApp

REQUEST = (
    "Add type hints to every parameter and return value of this Python code. Reply with the complete code.\n"
    "```python\n"
    "def moving_average(values, window):\n"
    "    result = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n"
    "        result.append(sum(chunk) / window)\n"
    "    return result\n"
    "\n"
    "def normalize(values):\n"
    "    low = min(values)\n"
    "    high = max(values)\n"
    "    return [(v - low) / (high - low) for v in values]\n"
    "```\n"
)


async def capture(app: SpekulaApp, out: Path, timeout: float) -> None:
    async with app.run_test(size=(150, 44)) as pilot:
        with anyio.fail_after(timeout):
            while not app.ready:
                await pilot.pause(0.1)
            # Input is one line: type the request with its newlines shown as spaces would lose the
            # code's shape, so set the value directly and submit it like Enter does.
            app.ask(REQUEST)
            app.query_one("#prompt").value = "Add type hints to every parameter and return value of this Python code…"  # type: ignore[attr-defined]
            while app.last_result is None:
                await pilot.pause(0.2)
            seen = app.n_stats_updates
            while app.n_stats_updates <= seen:
                await pilot.pause(0.1)
            await pilot.pause(0.3)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--n-predict", type=int, default=120)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "tui.svg")
    ap.add_argument("--timeout", type=float, default=900.0)
    a = ap.parse_args()
    argv = ["tui", "--temp", "0", "-c", "1024", "--spec-type", "ngram-simple,ngram-mod",
            "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "12",
            "--spec-ngram-mod-n-match", "8", "--spec-ngram-mod-n-min", "4", "--spec-ngram-mod-n-max", "16"]
    if a.model:
        argv += ["-m", a.model]
    args = build_parser(argv).parse_args(argv)
    # Greedy (--temp 0 above): the engine's defaults come from the parsed options, as in `spekula tui`.
    source = EmbeddedSource(lambda: build_engine(args), ServerDefaults(sampling=sampling_from_args(args)))
    app = SpekulaApp(source, n_predict=a.n_predict, poll_interval=0.5)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    anyio.run(capture, app, a.out, a.timeout)
    print(f"wrote {a.out}")
    try:
        import cairosvg  # type: ignore[import-not-found]
    except ImportError:
        print("cairosvg not installed: no PNG (pip install cairosvg)", file=sys.stderr)
        return 0
    png = a.out.with_suffix(".png")
    cairosvg.svg2png(url=str(a.out), write_to=str(png))
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
