"""Memory and step time of draft-mtp's head runtimes (native kernels vs torch float32) beside a native target.

A synthetic GLM-4.5-shaped glm4moe GGUF in Q8_0 (random weights): hidden 1024, 8 query / 2 key-value
heads of 128 with half-width rotary, GLM-4.5's 151552-token vocabulary, one dense lead block and one
MoE block of 64 experts of width 512 (8 used, one shared expert), and one MTP block of the same shape
that borrows the trunk's embedding and output head. Each runtime is measured in its own process:
resident memory after loading the target alone and the target plus the heads, then the seconds of a
one-row head step after a 64-row prefix (the drafter's decode), beside one target decode step.

    .venv/bin/python bench/native_mtp.py [--threads N]     # builds the file once under ~/.cache/spekula/bench
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from synthetic_model import CACHE, _tokenizer_meta

SHAPE = {"n_embd": 1024, "n_head": 8, "n_head_kv": 2, "head_dim": 128, "n_expert": 64, "n_expert_used": 8,
         "n_ff_exp": 512, "n_ff": 4096, "vocab": 151552}
PATH = CACHE / "synthetic-glm4moe-mtp-L2-Q8_0.gguf"
PREFIX, STEPS = 64, 20


def write(path: Path, seed: int = 0) -> Path:
    from spekula.fixtures.tiny_gguf import write_gguf

    s = SHAPE
    rng = np.random.default_rng(seed)
    E, hd, nh, nkv, X, F = s["n_embd"], s["head_dim"], s["n_head"], s["n_head_kv"], s["n_expert"], s["n_ff_exp"]

    def mat(*shape: int) -> tuple[np.ndarray, str]:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])), "Q8_0"

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    t: dict[str, object] = {"token_embd.weight": mat(s["vocab"], E), "output.weight": mat(s["vocab"], E),
                            "output_norm.weight": ones(E)}
    for i in range(3):  # block 0 dense, block 1 MoE, block 2 the MTP head
        b = f"blk.{i}."
        t |= {b + "attn_norm.weight": ones(E), b + "attn_q.weight": mat(nh * hd, E), b + "attn_k.weight": mat(nkv * hd, E),
              b + "attn_v.weight": mat(nkv * hd, E), b + "attn_output.weight": mat(E, nh * hd),
              b + "attn_q.bias": np.zeros(nh * hd, np.float32), b + "attn_k.bias": np.zeros(nkv * hd, np.float32),
              b + "attn_v.bias": np.zeros(nkv * hd, np.float32), b + "post_attention_norm.weight": ones(E)}
        if i == 0:
            t |= {b + "ffn_gate.weight": mat(s["n_ff"], E), b + "ffn_up.weight": mat(s["n_ff"], E),
                  b + "ffn_down.weight": mat(E, s["n_ff"])}
            continue
        t |= {b + "ffn_gate_inp.weight": rng.standard_normal((X, E), dtype=np.float32),
              b + "exp_probs_b.bias": np.zeros(X, np.float32), b + "ffn_gate_exps.weight": mat(X, F, E),
              b + "ffn_up_exps.weight": mat(X, F, E), b + "ffn_down_exps.weight": mat(X, E, F),
              b + "ffn_gate_shexp.weight": mat(F, E), b + "ffn_up_shexp.weight": mat(F, E),
              b + "ffn_down_shexp.weight": mat(E, F)}
    t |= {"blk.2.nextn.eh_proj.weight": mat(E, 2 * E), "blk.2.nextn.enorm.weight": ones(E),
          "blk.2.nextn.hnorm.weight": ones(E), "blk.2.nextn.shared_head_norm.weight": ones(E)}
    hparams = {"context_length": 8192, "embedding_length": E, "block_count": 3, "feed_forward_length": s["n_ff"],
               "attention.head_count": nh, "attention.head_count_kv": nkv, "attention.key_length": hd,
               "attention.value_length": hd, "rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-5,
               "rope.dimension_count": hd // 2, "expert_count": X, "expert_used_count": s["n_expert_used"],
               "expert_feed_forward_length": F, "expert_shared_count": 1, "leading_dense_block_count": 1,
               "expert_gating_func": 2, "expert_weights_scale": 2.5, "expert_weights_norm": True,
               "nextn_predict_layers": 1, "vocab_size": s["vocab"]}
    meta = {"general.name": "spekula synthetic GLM-4.5-shaped MoE with one MTP block (random weights)",
            **_tokenizer_meta(s["vocab"])}
    return write_gguf(path, "glm4moe", hparams, t, meta)  # type: ignore[arg-type]


def rss_mib() -> tuple[float, float]:
    """(resident, peak resident) MiB of this process."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def measure(runtime: str, threads: int) -> dict[str, float]:
    """Run in a child process: one runtime's numbers."""
    from spekula.core.backend import BackendOptions, SeqInput, load_backend
    from spekula.core.drafting.mtp_runtime import MtpRows
    from spekula.drafters.model.runtimes import load_mtp_runtime

    opts = BackendOptions(n_ctx=512, n_seq_max=1, threads=threads)
    target = load_backend("native", str(PATH), opts)
    out: dict[str, float] = {}
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPE["vocab"], PREFIX + 1).astype(np.int32)
    seq = target.new_seq()
    target.forward([SeqInput(seq, tokens[:PREFIX], 0)])
    t0 = time.perf_counter()
    for _ in range(STEPS):
        target.truncate(seq, PREFIX)
        target.forward([SeqInput(seq, tokens[PREFIX:], PREFIX)])
    out["target_step_ms"] = 1e3 * (time.perf_counter() - t0) / STEPS
    out["target_rss_mib"] = rss_mib()[0]  # after its forwards (their scratch and KV pages included)
    t0 = time.perf_counter()
    rt = load_mtp_runtime(runtime, target, None, opts)
    out["heads_load_s"] = time.perf_counter() - t0
    out["with_heads_rss_mib"], out["peak_rss_mib"] = rss_mib()
    hidden = rng.standard_normal((PREFIX + 1, SHAPE["n_embd"])).astype(np.float32)
    s = rt.new_seq()
    rt.decode([MtpRows(s, 0, tokens[:PREFIX], hidden[:PREFIX], 0, want_last=False)])
    t0 = time.perf_counter()
    for _ in range(STEPS):
        rt.truncate(s, PREFIX)
        rt.decode([MtpRows(s, 0, tokens[PREFIX:], hidden[PREFIX:], PREFIX)])
    out["head_step_ms"] = 1e3 * (time.perf_counter() - t0) / STEPS
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--measure", choices=["native", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.threads)))
        return 0
    if not PATH.is_file():
        print(f"writing {PATH} ...", file=sys.stderr)
        write(PATH)
    print(f"{PATH.name}: {PATH.stat().st_size / 2**20:.0f} MiB, {args.threads} threads")
    for runtime in ("native", "torch"):
        done = subprocess.run([sys.executable, __file__, "--measure", runtime, "--threads", str(args.threads)],
                              capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{runtime:6s} heads: target {r['target_rss_mib']:.0f} MiB -> with heads {r['with_heads_rss_mib']:.0f} MiB "
              f"(+{r['with_heads_rss_mib'] - r['target_rss_mib']:.0f}, peak {r['peak_rss_mib']:.0f}), "
              f"load {r['heads_load_s']:.1f} s, head step {r['head_step_ms']:.1f} ms "
              f"(target step {r['target_step_ms']:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
