"""Install trained heads as shipped heads: ``python -m spekula.training.install_head RUN_DIR ...``.

Each run folder's GGUF is copied into the package's heads folder (``drafters/model/heads``, or
``$SPEKULA_HEADS_DIR``) under a name saying which target it is for, and listed in its index with the
recipe that made it (the command line, seed, thread count, data and training time from train.json),
so ``--spec-type draft-eagle3`` / ``draft-dflash`` without ``-md`` finds it for that exact target file.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from spekula.core.errors import ConfigError, SpekulaError
from spekula.drafters.model.shipped_heads import register_head, shipped_heads_dir


def recipe_text(summary: dict[str, Any]) -> str:
    data = summary["data"]
    # Distillation time is not part of it: a run that found its feature cache did not spend it.
    return (f"{summary['command']} (seed {summary['seed']}, {summary['threads']} thread(s), {summary['device']}; "
            f"{data['sequences']} self-distilled sequences, {data['tokens']} tokens from {data['prompts']} prompts; "
            f"training {summary['train_seconds']:.0f} s)")


def install(run_dir: Path, target: str, heads_dir: Path) -> Path:
    try:
        summary = json.loads((run_dir / "train.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{run_dir}: no finished training run ({exc})") from None
    kind = str(summary["kind"])
    gguf = run_dir / str(summary["gguf"])
    name = f"{Path(target).stem}.{kind}.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / name
        shutil.copyfile(gguf, staged)
        return register_head(heads_dir, staged, kind, target, recipe_text(summary))


def main(argv: list[str] | None = None) -> int:
    from spekula.backends.gguf.default_model import ensure_default_model

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m spekula.training.install_head RUN_DIR [RUN_DIR ...] (target: the embedded model)",
              file=sys.stderr)
        return 2
    target = str(ensure_default_model(quiet=True))
    try:
        for run_dir in args:
            print(f"installed {install(Path(run_dir), target, shipped_heads_dir())}", file=sys.stderr)
    except SpekulaError as exc:
        print(f"install_head: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
