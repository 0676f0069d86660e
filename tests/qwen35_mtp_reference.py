"""Qwen3.5's MTP layers computed by transformers' own classes from the Hugging Face checkpoint (a different
code path from the GGUF runtimes it checks): MTP layer k is run as the one decoder layer of a one-layer
text model whose final norm is ``mtp.norm``; its input is ``mtp.fc [pre_fc_norm_embedding(E x);
pre_fc_norm_hidden(h)]``, the projection and norms every MTP layer shares (as vLLM runs them).
"""

from __future__ import annotations

from pathlib import Path

import torch


@torch.no_grad()
def qwen35_mtp_forward(path: Path, head: int, tokens: list[int],
                       hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], hout [T, H]) of MTP layer ``head`` over entries (tokens[P], hidden[P]) at P = 0..T-1."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    cfg.num_hidden_layers, cfg.layer_types = 1, ["full_attention"]
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    t = load_file(str(path / "model.safetensors"))
    layer = f"mtp.layers.{head}."
    state = {"model.layers.0." + n[len(layer):]: v for n, v in t.items() if n.startswith(layer) and ".experts." not in n}
    n_expert = getattr(cfg, "num_experts", 0)
    if n_expert:  # the checkpoint's per-expert matrices, as transformers' fused expert tensors hold them
        def experts(name: str) -> torch.Tensor:
            return torch.stack([t[f"{layer}mlp.experts.{e}.{name}.weight"] for e in range(n_expert)])

        state["model.layers.0.mlp.experts.gate_up_proj"] = torch.cat([experts("gate_proj"), experts("up_proj")], dim=1)
        state["model.layers.0.mlp.experts.down_proj"] = experts("down_proj")
    state |= {"model.norm.weight": t["mtp.norm.weight"], "model.embed_tokens.weight": t["model.embed_tokens.weight"],
              "lm_head.weight": t["lm_head.weight"]}
    model.load_state_dict(state, strict=True)
    norm = type(model.model.norm)

    def normed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        n = norm(x.shape[-1], eps=cfg.rms_norm_eps)
        n.weight.copy_(weight)
        return n(x)

    e = normed(model.model.embed_tokens(torch.tensor(tokens)), t["mtp.pre_fc_norm_embedding.weight"])
    h = normed(hidden.float(), t["mtp.pre_fc_norm_hidden.weight"])
    u = torch.cat([e, h], dim=-1) @ t["mtp.fc.weight"].T
    hout = model.model(inputs_embeds=u[None]).last_hidden_state[0]
    return model.lm_head(hout), hout
