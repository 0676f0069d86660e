"""draft-mtp through the real `spekula` command: output equal to plain decoding, llama.cpp's statistics line,
the type inferred from an MTP-only -md file, one clear error per bad input, and a server that keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import error_line, run_cli
from http_helpers import running

from spekula.core.stats.stats import DrafterStats
from spekula.fixtures import tiny_mtp
from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

pytestmark = pytest.mark.timeout(600)

PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown fox"
FIXED = ("--spec-adaptive", "off")  # full drafts: the statistics then depend on the heads alone


def generate(model: Path, *args: str) -> tuple[dict, str]:  # type: ignore[type-arg]
    proc = run_cli("generate", "-m", str(model), "-p", PROMPT, "-n", "16", "--temp", "0", "--json", "--ignore-eos", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def stats_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "statistics" in ln and "draft-mtp:" in ln]
    assert len(lines) == 1, stderr
    return lines[0]


def test_generate_with_the_targets_own_heads_and_with_md() -> None:
    target = tiny_mtp.agreeing_mtp_gguf(n_mtp=1)
    plain, _ = generate(target)
    own, err = generate(target, "--spec-type", "draft-mtp", *FIXED)
    assert own["tokens"] == plain["tokens"] and own["timings"]["draft_n"] > 0
    line = stats_line(err)
    assert line.startswith("spec common_specu: statistics        draft-mtp: #calls(b,g,a) =    1 ")
    _, st = DrafterStats.parse_line(line)
    # the constructed head: every draft is (at least partly) accepted; a drafted end-of-generation token
    # ends its round early even with --ignore-eos, so not every token is
    assert st.n_acc_drafts == st.n_gen_drafts == st.n_call_accept > 0 and st.n_acc_tokens > st.n_gen_tokens / 2
    assert "#mean acc len = " in line and "#acc rate/pos = (1.000, " in line
    # An MTP-only file given alone with -md implies draft-mtp (llama.cpp reads nextn.eh_proj in the last block).
    trunk = tiny_mtp.trunk_only_gguf()
    plain_trunk, _ = generate(trunk)
    md, err = generate(trunk, "-md", str(tiny_mtp.mtp_only_gguf(1)), *FIXED)
    assert md["tokens"] == plain_trunk["tokens"] and md["timings"]["draft_n"] > 0
    stats_line(err)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_generate_on_a_qwen35_target(moe: bool) -> None:
    """A hybrid (recurrent) target with its constructed MTP heads, on the default native backend and on torch;
    then its random heads from an MTP-only -md file, which implies draft-mtp, onto the target without them."""
    target = tiny_mtp.agreeing_qwen35_gguf(moe=moe, n_mtp=1)
    plain, _ = generate(target)
    for backend in ("native", "torch"):
        out, err = generate(target, "--spec-type", "draft-mtp", "--backend", backend, *FIXED)
        assert out["tokens"] == plain["tokens"] and out["timings"]["draft_n"] > 0
        _, st = DrafterStats.parse_line(stats_line(err))
        assert st.n_acc_drafts == st.n_gen_drafts > 0 and st.n_acc_tokens > st.n_gen_tokens / 2
    trunk = tiny_qwen35_gguf_path(moe=moe, variant="no_mtp")
    plain_trunk, _ = generate(trunk)
    md, err = generate(trunk, "-md", str(tiny_qwen35_gguf_path(moe=moe, n_mtp=2, variant="mtp_only")), *FIXED)
    assert md["tokens"] == plain_trunk["tokens"] and md["timings"]["draft_n"] > 0
    stats_line(err)
    line = error_line(run_cli("generate", "-m", str(trunk), "-p", "hi", "-n", "2", "-md", str(tiny_mtp.mtp_only_gguf(1))))
    assert "holds glm4moe MTP layers" in line


@pytest.mark.parametrize(("model", "draft", "needle"), [
    ("llama", None, "has no multi-token-prediction layers"),
    ("glm-trunk", None, "has no multi-token-prediction layers"),
    ("glm", "vocab", "has a vocabulary of 256 tokens"),
    ("glm", "hidden", "has hidden size 48"),
], ids=["llama-target", "glm-without-mtp", "md-vocabulary", "md-hidden-size"])
def test_bad_heads_are_one_error_line(model: str, draft: str | None, needle: str) -> None:
    path = {"llama": tiny_model_path("llama"), "glm-trunk": tiny_mtp.trunk_only_gguf(),
            "glm": tiny_mtp.random_mtp_gguf(1)}[model]
    args = ["generate", "-m", str(path), "-p", "hi", "-n", "2", "--spec-type", "draft-mtp"]
    bad = None if draft is None else tiny_mtp.mismatched_mtp_gguf(draft)  # type: ignore[arg-type]
    if bad is not None:
        args += ["-md", str(bad)]
    line = error_line(run_cli(*args))
    assert needle in line and str(bad or path) in line


def test_server_refuses_draft_mtp_per_request_and_keeps_serving(tmp_path: Path) -> None:
    """A server whose target has no MTP layers: a request asking for draft-mtp is a 400 naming why,
    and the next requests are served as before (the refusal loads and leaves nothing behind)."""
    with running(tiny_mtp.trunk_only_gguf(), "-np", "1", "-c", "128", log=tmp_path / "serve.log") as server:
        body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0}
        status, ref = server.post("/completion", body)
        assert status == 200
        for _ in range(2):
            status, err = server.post("/completion", {**body, "speculative.type": "draft-mtp"})
            assert status == 400, err
            assert "no multi-token-prediction layers" in err["error"]["message"]
            status, again = server.post("/completion", body)
            assert status == 200 and again["content"] == ref["content"]
        assert server.get("/health")[0] == 200


def test_preflight_checks_the_heads_without_loading_weights() -> None:
    """What a Ray front process checks before starting replicas: heads present and fitting the target."""
    import argparse

    from spekula.core.errors import SpekulaError
    from spekula.frontends.cli.options import add_engine_options, preflight

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    glm, trunk = str(tiny_mtp.random_mtp_gguf(1)), str(tiny_mtp.trunk_only_gguf())
    preflight(parser.parse_args(["-m", glm, "--spec-type", "draft-mtp"]))
    preflight(parser.parse_args(["-m", trunk, "-md", str(tiny_mtp.mtp_only_gguf(1))]))  # type inferred
    for args, needle in ((["-m", trunk, "--spec-type", "draft-mtp"], "no multi-token-prediction layers"),
                         (["-m", glm, "--spec-type", "draft-mtp", "-md", str(tiny_mtp.mismatched_mtp_gguf("vocab"))],
                          "vocabulary")):
        with pytest.raises(SpekulaError, match=needle):
            preflight(parser.parse_args(args))
