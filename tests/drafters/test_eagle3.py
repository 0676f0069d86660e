"""draft-eagle3 through the engine: lossless greedy output, pairing/rebase rules, drafting caps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from model_drafter_helpers import build_target, drafter_context, engine_vs_plain, target_backend

from spekula.backends.convert.hf import convert
from spekula.core.backend import SeqInput
from spekula.core.drafting.drafter import DraftRequest
from spekula.core.errors import ConfigError
from spekula.core.params import SamplingParams, SpecParams
from spekula.drafters.model.eagle3 import Eagle3Drafter
from spekula.fixtures import tiny_hf

SPEC = SpecParams(types=("draft-eagle3",), n_max=4, adaptive=False)  # full-length drafts: they are what is checked


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    hf, target = build_target(root)
    draft = root / "eagle3.gguf"
    convert(tiny_hf.write_eagle3(root / "e3-hf", layer_ids=(1, 4, 8)), draft, outtype="f32", target_dir=hf)
    return {"target": target, "draft": draft, "hf": hf}


def test_random_draft_is_lossless_through_the_engine(models: dict[str, Path]) -> None:
    outs, refs, st = engine_vs_plain(models["target"], models["draft"], Eagle3Drafter.create, SPEC)
    assert outs == refs
    assert st["gen_drafts"] > 0 and st["gen_tokens"] >= st["gen_drafts"]


def test_sampled_output_is_lossless(models: dict[str, Path]) -> None:
    sampling = SamplingParams(temperature=0.8, seed=7)
    outs, refs, _ = engine_vs_plain(models["target"], models["draft"], Eagle3Drafter.create, SPEC, sampling=sampling)
    assert outs == refs


def test_probabilistic_drafting_returns_q_and_stays_lossless(models: dict[str, Path]) -> None:
    sampling = SamplingParams(temperature=0.8, seed=11)
    spec = SPEC.with_(draft_sampling="probabilistic")
    outs, refs, st = engine_vs_plain(models["target"], models["draft"], Eagle3Drafter.create, spec, sampling=sampling)
    assert outs == refs and st["gen_drafts"] > 0
    target = target_backend(models["target"])
    d = Eagle3Drafter.create(drafter_context(target, models["draft"], spec))
    prompt = [5, 17, 200, 33, 99, 120, 7, 8]
    _observe(d, target, 0, target.new_seq(), prompt, 0)
    d.begin(0, np.array(prompt))
    (draft,) = d.draft([DraftRequest(0, np.array(prompt), 42, 8, spec, 0.8, 11)])
    assert draft.probs is not None and draft.probs.shape == (len(draft.tokens), tiny_hf.VOCAB)
    np.testing.assert_allclose(draft.probs.sum(1), 1.0, atol=1e-5)
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
    assert (np.count_nonzero(draft.probs, axis=1) <= 10).all()  # top-10 candidates only


def _observe(drafter: Eagle3Drafter, target, slot: int, seq: int, tokens: list[int], start: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    from spekula.core.backend import Capture

    inp = SeqInput(seq, np.array(tokens, dtype=np.int32), start)
    out = target.forward([inp], Capture(layers=frozenset(drafter.layers)))[0]
    drafter.observe(slot, inp, out)
    return out.logits[-1]


def test_pairing_bridge_and_rebase(models: dict[str, Path]) -> None:
    """Chunked prompt == one-shot prompt (bridge); accept(n) moves the pending row to the accepted one."""
    target = target_backend(models["target"])
    d = Eagle3Drafter.create(drafter_context(target, models["draft"], SPEC))
    prompt = [5, 17, 200, 33, 99, 120, 7, 8]
    s0, s1 = target.new_seq(), target.new_seq()
    _observe(d, target, 0, s0, prompt, 0)
    _observe(d, target, 1, s1, prompt[:3], 0)
    _observe(d, target, 1, s1, prompt[3:], 3)
    for slot in (0, 1):
        d.begin(slot, np.array(prompt))
    st0, st1 = d._slots.get(0), d._slots.get(1)
    assert st0.pending_pos == st1.pending_pos == len(prompt) - 1
    assert d._length(st0) == d._length(st1) == len(prompt) - 1
    assert d.runtime.seq_len(st0.seq) == 0  # queued, not decoded: nothing asked for a draft yet
    np.testing.assert_allclose(st0.pending_feat, st1.pending_feat, atol=1e-5)
    reqs = [DraftRequest(s, np.array(prompt), 42, 8, SPEC, 0.0, 0) for s in (0, 1)]
    a, b = d.draft(reqs)
    assert a.tokens == b.tokens and len(a.tokens) == SPEC.n_max
    assert d.runtime.seq_len(st0.seq) == len(prompt) - 1  # the queue decoded, drafted entries dropped again
    # Verification batch [x, d1, d2, d3, d4] at len(prompt); accept 2 -> pending row = index 2.
    _observe(d, target, 0, s0, [42, *a.tokens], len(prompt))
    rows = st0.verify_feat
    d.accept(0, 2, True)
    assert st0.pending_pos == len(prompt) + 2
    np.testing.assert_array_equal(st0.pending_feat, rows[2])
    assert d._length(st0) == len(prompt) + 2


def test_the_lazy_draft_kv_drafts_what_an_update_after_every_forward_drafts(models: dict[str, Path]) -> None:
    """Rounds in which the drafter is not asked only queue rows; the drafts once it is asked are the
    same as with the draft KV brought up to date after every target forward."""
    target = target_backend(models["target"])
    lazy = Eagle3Drafter.create(drafter_context(target, models["draft"], SPEC))
    eager = Eagle3Drafter.create(drafter_context(target, models["draft"], SPEC))
    history = [5, 17, 200, 33, 99, 120, 7, 8]
    seqs = {id(d): target.new_seq() for d in (lazy, eager)}
    for d in (lazy, eager):
        _observe(d, target, 0, seqs[id(d)], history, 0)
        d.begin(0, np.array(history))
    rng = np.random.default_rng(3)
    drafts: dict[int, list[list[int]]] = {id(lazy): [], id(eager): []}
    x = 42
    for rnd in range(6):
        guess = [int(t) for t in rng.integers(0, tiny_hf.VOCAB, 3)]
        n_acc = int(rng.integers(0, 4))
        for d in (lazy, eager):
            st = d._slots.get(0)
            if rnd % 3 == 2:  # asked for a draft every third round
                drafts[id(d)].append(d.draft([DraftRequest(0, np.array(history), x, 8, SPEC, 0.0, 0)])[0].tokens)
            _observe(d, target, 0, seqs[id(d)], [x, *guess], len(history))
            d.accept(0, n_acc, False)
            if d is eager:
                _flush(d, st)
                assert st.queued == 0 and d.runtime.seq_len(st.seq) == st.pending_pos
        history = [*history, x, *guess[:n_acc]]
        x = int(rng.integers(0, tiny_hf.VOCAB))
    assert drafts[id(lazy)] == drafts[id(eager)] and all(drafts[id(lazy)])


def test_caps_p_min_n_min(models: dict[str, Path]) -> None:
    target = target_backend(models["target"])
    d = Eagle3Drafter.create(drafter_context(target, models["draft"], SPEC))
    prompt = [5, 17, 200, 33, 99, 120, 7, 8]
    _observe(d, target, 0, target.new_seq(), prompt, 0)
    d.begin(0, np.array(prompt))

    def run(**kw: object) -> list[int]:
        budget = int(kw.pop("budget", 8))  # type: ignore[call-overload]
        spec = SPEC.with_(**kw)
        return d.draft([DraftRequest(0, np.array(prompt), 42, budget, spec, 0.0, 0)])[0].tokens

    full = run(n_max=6)
    assert len(full) == 6
    assert run(n_max=6, budget=2) == full[:2]
    assert run(n_max=3) == full[:3]
    assert run(n_max=6, n_min=7) == []
    assert run(n_max=6, p_min=1.01) == []  # top-10 probability never exceeds 1
    with pytest.raises(ConfigError, match="not EAGLE-3"):
        Eagle3Drafter.create(drafter_context(target, _dflash_file(models), SPEC))


def _dflash_file(models: dict[str, Path]) -> Path:
    out = models["draft"].with_name("dflash-for-type-check.gguf")
    if not out.exists():
        convert(tiny_hf.write_dflash(out.with_suffix(""), layer_ids=(1, 6)), out, outtype="f32", target_dir=models["hf"])
    return out


def test_needs_a_draft_model(models: dict[str, Path]) -> None:
    from spekula.core.drafting.drafter import DrafterContext

    target = target_backend(models["target"])
    with pytest.raises(ConfigError, match="-md"):
        Eagle3Drafter.create(DrafterContext(spec=SPEC, target=target, tokenizer=None, n_seq_max=1))


def test_oracle_draft_is_fully_accepted(tmp_path: Path) -> None:
    """A draft built to compute the target's next-token function: every drafted token is accepted,
    so acceptance, bonus tokens and the pending-row rebase after full acceptance all get exercised."""
    target_hf = tiny_hf.write_bigram_target(tmp_path / "bigram")
    f, gap = tiny_hf.bigram_map(target_hf)
    assert gap > 1e-4  # no near-ties (fp32 error here is ~1e-6): fp32 and fp64 agree on f
    assert len(set(f.tolist())) > 20  # a real mapping, not a constant
    target = tmp_path / "bigram.gguf"
    convert(target_hf, target, outtype="f32")
    draft = tmp_path / "oracle.gguf"
    convert(tiny_hf.write_eagle3_oracle(tmp_path / "oracle", f), draft, outtype="f32", target_dir=target_hf)
    outs, refs, st = engine_vs_plain(target, draft, Eagle3Drafter.create, SPEC, n_predict=30)
    assert outs == refs
    for out in outs:  # the target really follows f
        assert all(int(f[a]) == b for a, b in zip(out, out[1:], strict=False))
    assert st["gen_tokens"] > 20 and st["acc_tokens"] == st["gen_tokens"]


@pytest.mark.slow
def test_smollm2_random_draft_is_lossless(tmp_path: Path) -> None:
    """Real target (Q4_1/Q8_0): embeddings borrowed from the quantized file, captured layers of a 30-layer model."""
    from model_drafter_helpers import random_draft_gguf, smollm2_or_skip

    target = smollm2_or_skip()
    draft = random_draft_gguf(tmp_path / "e3.gguf", "eagle3", target)
    outs, refs, st = engine_vs_plain(target, draft, Eagle3Drafter.create, SPEC, n_predict=8)
    assert outs == refs and st["gen_drafts"] > 0


def _flush(d: Eagle3Drafter, st: object) -> np.ndarray:
    """Decode a slot's queued rows into the draft KV now; returns its encoded pending row g."""
    [rows], [g] = d._take_queue([st])  # type: ignore[list-item]
    if rows is not None:
        d.runtime.decode([rows])
    return g


def _step0_logits(d: Eagle3Drafter, r: DraftRequest) -> np.ndarray | None:
    """The draft's first-step logits for this request, computed from its current caches (then undone)."""
    from spekula.core.drafting.draft_models import Eagle3Rows

    st, pos = d._slots.get(r.slot), len(r.history) - 1
    if st is None or st.pending_feat is None or st.pending_pos != pos or d._length(st) < pos:
        return None
    d._cut(st, pos)
    g = _flush(d, st)  # brings the draft KV up to date, as draft() is about to
    out = d.runtime.decode([Eagle3Rows(st.seq, np.array([r.last], np.int32), g[None], pos)])[0]
    d.runtime.truncate(st.seq, pos)
    assert out.logits is not None
    return out.logits[-1]


def test_drafts_made_in_the_engine_equal_a_from_scratch_reference(models: dict[str, Path]) -> None:
    """Every draft of a 2-slot engine run (prompt chunks, verification rounds, partial acceptance) equals the
    HF-formulation EAGLE-3 recomputed from scratch over the committed history: first-step logits within
    1e-4 and the chained tokens; pairing, bridge and rebase keep the draft KV what a fresh run would build."""
    import hf_reference as R
    import torch
    from model_drafter_helpers import agree_unless_near_tie, assert_logits_close, recorded_drafts

    spec = SPEC.with_(n_max=3)
    log = recorded_drafts(models["target"], models["draft"], Eagle3Drafter.create, spec, probe=_step0_logits)
    draft_hf = models["draft"].parent / "e3-hf"
    checked = 0
    for history, last, tokens, step0 in log:
        _, states = R.target_forward(models["hf"], history)
        feats = torch.cat([states[i] for i in (1, 4, 8)], dim=-1)
        cfg, t = R._eagle3_tensors(draft_hf)
        g = feats.double() @ t["fc.weight"].T
        toks = [*history[1:], last]
        rows = []
        for tok in tokens:
            logits, prenorm = R.eagle3_layer(draft_hf, models["hf"], g, toks)
            rows.append(logits[-1].numpy())
            g = torch.cat([g, prenorm[-1:]])
            toks = [*toks, tok]
        assert_logits_close(step0, rows[0])
        checked += agree_unless_near_tie(tokens, rows)
    assert len(log) > 10 and checked > 2 * len(log)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("moe", [False, True])
def test_random_draft_is_lossless_on_a_hybrid_target(tmp_path: Path, backend: str, moe: bool) -> None:
    """EAGLE-3 over a Qwen3.5 target: the captured layer inputs of delta-net and attention blocks feed the
    head, and the target's recurrent state rolls back under its drafts."""
    from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path, tiny_qwen35_hf_path

    draft = tmp_path / "e3.gguf"
    convert(tiny_hf.write_eagle3(tmp_path / "e3-hf", layer_ids=(0, 1, 3)), draft, outtype="f32",
            target_dir=tiny_qwen35_hf_path(moe=moe))
    outs, refs, st = engine_vs_plain(tiny_qwen35_gguf_path(moe=moe), draft, Eagle3Drafter.create, SPEC, backend=backend)
    assert outs == refs
    assert st["gen_drafts"] > 0
