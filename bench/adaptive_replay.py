"""Adaptive draft lengths against fixed ones on a replay of SmolLM2: the same decisions, without the noise.

    .venv/bin/python bench/adaptive_replay.py [-m MODEL.gguf] [-n 128] [--threads 2] [--reps 3] [--records F]

On this machine the speed of plain decoding moves by tens of percent from one minute to the next,
which hides differences of a few percent between planners. This script first records, on the real
model, the greedy answer to each workload of bench/adaptive.py and how long a forward of 1..65 rows
takes at that context length; it then runs the engine unchanged against a backend that replays the
recorded answer (its logits pick the recorded next token wherever the sequence so far is the
recorded one) and waits exactly the recorded time of each forward. Drafting, planning and the rest
of the engine run for real. So the planner's choices meet the real model's acceptance and the real
cost of its rows, and two planners compared here differ only by their decisions and their own
overhead. It is not a measurement of the machine: bench/adaptive.py is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/ is not a package
from adaptive import CAPS, PAIR, REPETITIVE, SINGLE, Bench, caps_options  # noqa: E402

from spekula.core.backend import Backend, BackendOptions, Capture, ModelInfo, SeqInput, SeqOutput  # noqa: E402

MAX_ROWS = 65
SPIN = 2e-4  # seconds of each replayed forward spent spinning
CURVE_PASSES = 5


class ReplayBackend(Backend):
    """Answers with one recorded greedy continuation and takes the recorded time per forward."""

    def __init__(self, info: ModelInfo, options: BackendOptions) -> None:
        self.info, self.options = info, options
        self.record = np.zeros(0, dtype=np.int32)  # prompt + answer, as plain decoding produced it
        self.seconds = [0.0] * (MAX_ROWS + 1)  # forward time by row count
        self._buf: dict[int, np.ndarray] = {}
        self._len: dict[int, int] = {}
        self._agree: dict[int, int] = {}  # positions equal to the record, from the start

    def load(self, record: Sequence[int], seconds: Sequence[float]) -> None:
        self.record = np.asarray(record, dtype=np.int32)
        self.seconds = list(seconds)

    def new_seq(self) -> int:
        seq = next(i for i in range(self.options.n_seq_max + 1) if i not in self._buf)
        self._buf[seq] = np.zeros(self.options.n_ctx, dtype=np.int32)
        self._len[seq] = self._agree[seq] = 0
        return seq

    def free_seq(self, seq_id: int) -> None:
        del self._buf[seq_id], self._len[seq_id], self._agree[seq_id]

    def seq_len(self, seq_id: int) -> int:
        return self._len[seq_id]

    def truncate(self, seq_id: int, n_keep: int) -> None:
        self._len[seq_id] = min(self._len[seq_id], n_keep)
        self._agree[seq_id] = min(self._agree[seq_id], n_keep)

    def forward(self, inputs: Sequence[SeqInput], capture: Capture = Capture()) -> list[SeqOutput]:  # noqa: B008 - the ABC's signature
        t0 = time.perf_counter()
        rows_total = sum(len(i.tokens) for i in inputs)
        outs = []
        for inp in inputs:
            buf, n = self._buf[inp.seq_id], len(inp.tokens)
            buf[inp.start:inp.start + n] = inp.tokens
            self._len[inp.seq_id] = inp.start + n
            agree = min(self._agree[inp.seq_id], inp.start)
            while agree < inp.start + n and agree < len(self.record) and buf[agree] == self.record[agree]:
                agree += 1
            self._agree[inp.seq_id] = agree
            rows = np.array([n - 1]) if inp.logit_rows is None else np.asarray(inp.logit_rows, dtype=np.int64)
            logits = np.zeros((len(rows), self.info.n_vocab), dtype=np.float32)
            for j, r in enumerate(rows):
                pos = inp.start + int(r)
                # The recorded next token where the sequence so far is the recorded one; elsewhere
                # any token (verification never emits past a rejected draft token).
                nxt = self.record[pos + 1] if pos + 1 < min(agree + 1, len(self.record)) else 0
                logits[j, nxt] = 10.0
            outs.append(SeqOutput(logits=logits))
        deadline = t0 + self.seconds[min(rows_total, len(self.seconds) - 1)]
        # Sleep (releasing the GIL, as the real backend's C code does) until just before the deadline,
        # then spin: sleep() alone overshoots by tens of microseconds.
        if deadline - time.perf_counter() > SPIN:
            time.sleep(deadline - time.perf_counter() - SPIN)
        while time.perf_counter() < deadline:
            pass
        return outs


def record_workload(real: Backend, prompt: list[int], n_predict: int, eog: set[int]) -> tuple[list[int], list[float]]:
    """Plain greedy answer on the real backend, and the time of a forward of n rows after the prompt."""
    seq = real.new_seq()
    try:
        out = real.forward([SeqInput(seq, np.asarray(prompt, dtype=np.int32), 0)])[0]
        answer: list[int] = []
        nxt = int(np.argmax(out.logits[-1]))
        while len(answer) < n_predict:
            answer.append(nxt)
            if nxt in eog:
                break
            out = real.forward([SeqInput(seq, np.asarray([nxt], dtype=np.int32), len(prompt) + len(answer) - 1)])[0]
            nxt = int(np.argmax(out.logits[-1]))
        ctx = len(prompt) + len(answer) // 2  # the middle of the answer: the typical context of a round
        seconds = [0.0] + [float("inf")] * MAX_ROWS
        text = np.asarray(prompt + answer, dtype=np.int32)
        # The fastest of CURVE_PASSES timings per row count, each pass over every row count in turn: a
        # slow spell of the machine then costs one timing of many row counts, not all timings of a few
        # (which the running maximum below would carry on to every larger row count).
        for _ in range(CURVE_PASSES):
            for n in range(1, MAX_ROWS + 1):
                real.truncate(seq, ctx)
                tokens = np.resize(text[ctx - n + 1:ctx + 1], n).astype(np.int32)
                t0 = time.perf_counter()
                real.forward([SeqInput(seq, tokens, ctx, np.arange(n))])
                seconds[n] = min(seconds[n], time.perf_counter() - t0)
        # The curve as the engine's own forwards see it: never falling as rows are added.
        for n in range(2, len(seconds)):
            seconds[n] = max(seconds[n], seconds[n - 1])
        return prompt + answer, seconds
    finally:
        real.free_seq(seq)


class ReplayBench(Bench):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.real = self.backend
        self.backend = ReplayBackend(self.real.info, BackendOptions(n_ctx=self.real.n_ctx, n_seq_max=1))
        self.records: dict[str, tuple[list[int], list[float]]] = {}

    def prepare(self, name: str, text: str) -> list[int]:
        prompt = self.chat_prompt(text)
        saved = self._saved()
        key = f"{name}/{self.args.n_predict}"
        if key in saved and saved[key][0][:len(prompt)] == prompt:
            self.records[name] = saved[key]
            return prompt
        eog = {t for t in range(self.real.info.n_vocab) if self.tokenizer.is_eog(t)}
        self.records[name] = saved[key] = record_workload(self.real, prompt, self.args.n_predict, eog)
        if getattr(self.args, "records", None):
            Path(self.args.records).write_text(json.dumps(saved))
        return prompt

    def _saved(self) -> dict[str, Any]:
        """Records kept in --records FILE: replaying the same records on two checkouts compares their
        decisions alone, where two recordings would also differ by the machine's speed at the time."""
        path = getattr(self.args, "records", None)
        if not path or not Path(path).is_file():
            return {}
        return {k: (list(v[0]), list(v[1])) for k, v in json.loads(Path(path).read_text()).items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="rotating repetitions per configuration (median ratio)")
    p.add_argument("--workloads", default=",".join(SINGLE))
    p.add_argument("--records", help="JSON file of recorded answers and forward times: used where it holds the "
                   "workload, written with new recordings")
    args = p.parse_args(argv)
    args.backend = "native"
    bench = ReplayBench(args)
    print(f"model {Path(bench.model).name}, replayed forwards timed on the native backend, {args.threads} threads")
    failures = 0
    print("\n| workload | config | x plain | acc | rounds |")
    print("|---|---|---:|---|---:|")
    summary: list[str] = []
    for wname in args.workloads.split(","):
        prompt = bench.prepare(wname, SINGLE[wname])
        record, seconds = bench.records[wname]
        bench.backend.load(record, seconds)
        want = record[len(prompt):]
        configs: dict[str, tuple[tuple[str, ...], bool, dict[str, Any]]] = {"plain": ((), False, {})}
        for label, types in (("pair", PAIR), ("suffix", ("suffix",))):
            configs[f"{label} fixed"] = (types, False, {})
            if wname in REPETITIVE:  # the sweep of caps is for the repetitive workloads
                for cap in CAPS:
                    configs[f"{label} fixed {cap}"] = (types, False, caps_options(cap))
            configs[f"{label} adaptive"] = (types, True, {})
        names = list(configs)
        tps: dict[str, list[float]] = {n: [] for n in names}
        finals: dict[str, Any] = {}
        for rep in range(args.reps):  # rotating order, each ratio against the plain run of its repetition
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                final = bench.one(prompt, *configs[name])
                if list(final.tokens) != want:
                    failures += 1
                    print(f"OUTPUT DIFFERS: {wname}/{name}")
                tps[name].append(final.timings["predicted_per_second"])
                finals[name] = final
        ratio = {n: statistics.median(a / b for a, b in zip(tps[n], tps["plain"], strict=True)) for n in names}
        for name in names:
            t = finals[name].timings
            acc = f"{t.get('draft_n_accepted', 0)}/{t.get('draft_n', 0)}"
            rounds = len(finals[name].tokens) - t.get("draft_n_accepted", 0)
            print(f"| {wname} | {name} | {ratio[name]:.3f}x | {acc} | {rounds} |")
        for label in ("pair", "suffix"):
            best = max((n for n in names if n.startswith(f"{label} fixed")), key=lambda n: ratio[n])
            a = ratio[f"{label} adaptive"]
            summary.append(f"| {wname} | {label} | {a:.3f}x | {best} {ratio[best]:.3f}x | {a / ratio[best]:.3f}x |")
    print("\n| workload | drafters | adaptive x plain | best fixed x plain | adaptive / best fixed |")
    print("|---|---|---:|---|---:|")
    print("\n".join(summary))
    bench.real.close()
    print("\nFAIL: outputs differ" if failures else "\nOK: every output equals plain decoding")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
