"""Process start to first token: `spekula generate -n 1` against llama.cpp's `llama-completion -n 1`.

    .venv/bin/python bench/startup.py [-m MODEL.gguf] [--rounds 7] [--threads N] [--prompt TEXT]
        [--llama-completion PATH] [--spekula PATH] [-- EXTRA SPEKULA OPTIONS]

Both run as fresh processes on the same GGUF (default: the embedded SmolLM2-135M-Instruct Q4_1), the
same prompt, greedy, one generated token, the same thread count and context size, alternating in
every round (the order flips from round to round) so that a busy machine slows both alike. With
`-n 1` a process ends right after its first token, so its wall time from spawn to exit is its time to
first token (plus its teardown, which both pay). Reported: the median and min wall time of each, the
spekula / llama-completion ratio of both, each one's median CPU time (user + system: less disturbed
than wall time by other work on a shared machine, though spinning worker threads count in it) and
peak RSS (the child's ru_utime, ru_stime and ru_maxrss from wait4).

One untimed round comes first: it warms the page cache for both, and lets Python write the bytecode
cache of spekula's modules as an installed package has it (PYTHONDONTWRITEBYTECODE is dropped from
the children's environment, so a checkout behaves like a wheel install).

llama-completion is found by --llama-completion, else $SPEKULA_LLAMA_COMPLETION, else PATH; without
it only spekula's times are reported. It runs with -no-cnv (no chat loop) and --no-warmup (no empty
decode before the prompt: spekula does none either).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

N_CTX = 2048


@dataclass
class Samples:
    """One command's wall and CPU times (s) and peak RSS (KiB) over the rounds."""

    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)

    def summary(self) -> str:
        return (f"median {statistics.median(self.seconds):.3f} s  min {min(self.seconds):.3f} s  "
                f"CPU median {statistics.median(self.cpu_seconds):.3f} s  peak RSS {max(self.rss_kib) / 1024:.0f} MiB")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, each running both (default: 7)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both (default: all CPUs)")
    p.add_argument("--prompt", default="Hello", help="prompt text (default: Hello)")
    p.add_argument("--llama-completion", default=None, metavar="PATH",
                   help="llama.cpp's llama-completion (default: $SPEKULA_LLAMA_COMPLETION, else PATH)")
    p.add_argument("--spekula", default=None, metavar="PATH",
                   help="the spekula console script (default: the one beside this Python)")
    p.add_argument("extra", nargs="*", help="more `spekula generate` options, after --")
    return p.parse_args(argv)


def find_llama_completion(given: str | None) -> str | None:
    path = given or os.environ.get("SPEKULA_LLAMA_COMPLETION") or shutil.which("llama-completion")
    if path and not Path(path).is_file():
        raise SystemExit(f"llama-completion not found at {path}")
    return path


def default_model() -> str:
    from spekula.backends.gguf.default_model import ensure_default_model

    return str(ensure_default_model())


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # see the module docstring
    return env


def run_once(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall seconds from spawn to exit, CPU seconds, peak RSS in KiB) of one run; stderr kept for a failure."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read()[-3000:].decode(errors="replace")
            raise SystemExit(f"{cmd[0]} exited with {proc.returncode}:\n{tail}")
    return seconds, usage.ru_utime + usage.ru_stime, int(usage.ru_maxrss)  # Linux: KiB


def commands(args: argparse.Namespace, model: str, llama: str | None) -> dict[str, list[str]]:
    spekula = args.spekula or str(Path(sys.executable).with_name("spekula"))
    common = ["-m", model, "-p", args.prompt, "-n", "1", "--temp", "0", "-t", str(args.threads), "-c", str(N_CTX)]
    cmds = {"spekula": [spekula, "generate", *common, *args.extra]}
    if llama:
        cmds["llama-completion"] = [llama, *common, "-no-cnv", "--no-warmup"]
    return cmds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    llama = find_llama_completion(args.llama_completion)
    model = args.model or default_model()
    cmds = commands(args, model, llama)
    env = child_env()
    for cmd in cmds.values():  # untimed: page cache and bytecode cache
        run_once(cmd, env)
    samples = {name: Samples() for name in cmds}
    names = list(cmds)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, cpu, rss = run_once(cmds[name], env)
            samples[name].seconds.append(seconds)
            samples[name].cpu_seconds.append(cpu)
            samples[name].rss_kib.append(rss)
    print(f"model {model}, {args.threads} threads, {args.rounds} rounds, prompt {args.prompt!r}")
    for name, s in samples.items():
        print(f"{name:>17}: {s.summary()}")
    if llama:
        sp, ll = samples["spekula"], samples["llama-completion"]
        print(f"{'spekula / llama':>17}: median {statistics.median(sp.seconds) / statistics.median(ll.seconds):.2f}x"
              f"  min {min(sp.seconds) / min(ll.seconds):.2f}x"
              f"  CPU median {statistics.median(sp.cpu_seconds) / statistics.median(ll.cpu_seconds):.2f}x"
              f"  peak RSS {max(sp.rss_kib) / max(ll.rss_kib):.2f}x")
    else:
        print("llama-completion not given (--llama-completion, $SPEKULA_LLAMA_COMPLETION or PATH): no ratio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
