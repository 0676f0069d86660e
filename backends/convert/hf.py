"""`spekula convert`: pick the converter for a Hugging Face checkpoint from its config, run it.

numpy + the gguf writer only (no torch), so conversion works on machines without a torch build.
"""

from __future__ import annotations

from pathlib import Path

from spekula.backends.convert.dflash import convert_dflash, dflash_kind
from spekula.backends.convert.eagle3 import EAGLE3_ARCHS, convert_eagle3, is_eagle3
from spekula.backends.convert.moe import MOE_ARCHS, MTP_MODES, convert_moe
from spekula.backends.convert.output import check_output_path
from spekula.backends.convert.plain import PLAIN_ARCHS, convert_plain
from spekula.backends.convert.qwen35 import QWEN35_ARCHS, convert_qwen35
from spekula.backends.convert.source import HFCheckpoint
from spekula.backends.convert.target import open_target
from spekula.core.errors import ConfigError, ModelFileError

# Layout -> how messages name it, with its article: "a eagle3 draft" read badly.
_DRAFT_NAMES = {"eagle3": "an EAGLE-3", "dflash": "a DFlash", "dspark": "a DSpark"}


def detect_layout(ckpt: HFCheckpoint) -> str:
    """'plain', 'moe', 'qwen35', 'eagle3', 'dflash' or 'dspark'; a clear error for anything else."""
    cfg = ckpt.config
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ModelFileError(ckpt.path / "config.json", "missing 'architectures'")
    # A DFlash architecture or dflash_config first: a one-layer DFlash head with a draft vocabulary
    # (draft_vocab_size) would otherwise look like an EAGLE-3 head saved without its architecture.
    kind = dflash_kind(cfg)
    if kind is not None:
        return kind
    if is_eagle3(cfg):
        return "eagle3"
    if archs[0] in PLAIN_ARCHS:
        return "plain"
    if archs[0] in MOE_ARCHS:
        return "moe"
    if archs[0] in QWEN35_ARCHS:
        return "qwen35"
    known = ", ".join([*PLAIN_ARCHS, *MOE_ARCHS, *QWEN35_ARCHS, *EAGLE3_ARCHS, "DFlashDraftModel", "Qwen3DSparkModel", "DSparkDraftModel"])
    raise ModelFileError(ckpt.path / "config.json", f"unknown checkpoint layout {archs[0]!r}; supported: {known}")


def convert(checkpoint: str | Path, outfile: str | Path, *, outtype: str = "f16",
            target_dir: str | Path | None = None, target_gguf: str | Path | None = None,
            pre: str | None = None, mtp: str = "keep") -> tuple[str, Path]:
    """Convert ``checkpoint`` to ``outfile``; returns (layout, path written).

    A draft (EAGLE-3, DFlash, DSpark) names its target by exactly one of ``target_dir`` (its HF folder)
    and ``target_gguf`` (its GGUF file, whose vocabulary the draft then copies). ``mtp`` handles a checkpoint's multi-token-prediction layers: "keep" them after the trunk, "drop"
    them (``--no-mtp``) or write "only" them as a draft file (``--mtp``)."""
    if mtp not in MTP_MODES:
        raise ConfigError(f"unknown mtp mode {mtp!r}; choose one of {', '.join(MTP_MODES)}")
    ckpt = HFCheckpoint.open(checkpoint)
    layout = detect_layout(ckpt)
    out = Path(outfile)
    check_output_path(out, "--outfile")
    if mtp != "keep" and layout not in ("moe", "qwen35"):
        raise ConfigError(f"--mtp / --no-mtp apply to checkpoints with MTP layers (Glm4MoeForCausalLM, Qwen3.5), "
                          f"not to a {layout} checkpoint")
    if layout == "plain":
        return layout, convert_plain(ckpt, out, outtype, pre=pre)
    if layout == "moe":
        return layout, convert_moe(ckpt, out, outtype, pre=pre, mtp=mtp)
    if layout == "qwen35":
        return layout, convert_qwen35(ckpt, out, outtype, pre=pre, mtp=mtp)
    target = open_target(target_dir, target_gguf, _DRAFT_NAMES[layout])
    if layout == "eagle3":
        return layout, convert_eagle3(ckpt, target, out, outtype, pre=pre)
    return layout, convert_dflash(ckpt, target, out, outtype, pre=pre)
